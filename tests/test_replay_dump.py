"""tpguard/dump.py: what a dump holds for `tpguard replay`, from the harness's values and from
SGLang's own SamplingBatchInfo (the plugin's entry point), read back by the replay reader."""

from __future__ import annotations

import json

import pytest
import torch

from tpguard.dump import (DUMP_FORMAT, context_from_sampling_info, dump_name, dumps_dir, make_context,
                          sampling_params, write_dump)
from tpguard.replay.reader import load_rank_dump


def test_sampling_params_repeat_per_verify_row_and_keep_top_k_as_given():
    p = sampling_params(torch.tensor([[0.7], [1.0]]), [0, 1 << 30], [0.9, 1.0], [0.0, 0.05], rows_per_request=3)
    assert p["temperature"].tolist() == [0.699999988079071] * 3 + [1.0] * 3 and p["temperature"].dtype == torch.float32
    assert p["top_k"].tolist() == [0] * 3 + [1 << 30] * 3 and p["top_k"].dtype == torch.int64
    assert p["top_p"].shape == p["min_p"].shape == (6,)


@pytest.mark.slow
def test_context_from_sglang_sampling_batch_info():
    pytest.importorskip("sglang.srt.sampling.sampling_batch_info", reason="sglang 0.5.23 is not installed here")
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    info = SamplingBatchInfo(temperatures=torch.tensor([[0.8], [1.2]]), top_ps=torch.tensor([0.9, 1.0]),
                             top_ks=torch.tensor([40, TOP_K_ALL], dtype=torch.int32),
                             min_ps=torch.tensor([0.0, 0.1]), is_all_greedy=False, is_any_greedy=False,
                             need_top_p_sampling=True, need_top_k_sampling=True, need_min_p_sampling=True,
                             vocab_size=4096)
    ctx = context_from_sampling_info(info, 4, algo="dflash", renorm_name="flashinfer",
                                     renorm_source="flashinfer.sampling", deterministic=False, device="cpu")
    assert ctx.probs == {"path": "dense", "stages": ["top_k", "top_p"]}  # the dense verify path has no min-p
    assert ctx.tree_parents == [-1, 0, 1, 2] and ctx.algo == "dflash"
    assert ctx.params["top_k"].tolist() == [40] * 4 + [TOP_K_ALL] * 4
    sparse = context_from_sampling_info(info, 4, algo="dflash", renorm_name="flashinfer", sparse_topk=True,
                                        device="cpu")
    assert sparse.probs["path"] == "sparse_topk"


def test_write_dump_layout_metadata_and_read_back(tmp_path):
    ctx = make_context("eagle", tree_parents=[-1, 0, 0, 1], renorm_name="torch", deterministic=True,
                       params=sampling_params([1.0], [0], [0.9], [0.0], 4), coins_shapes=[(1, 5)])
    path = write_dump(dumps_dir(tmp_path), run_id="r-1.x", step=12, site="eagle.verify", rank=1, world_size=2,
                      quantities=["target_probs", "bonus"], context=ctx,
                      tensors={"target_probs": torch.rand(4, 16), "bonus": torch.tensor([3])})
    assert path == str(tmp_path / "dumps" / dump_name("r-1.x", 12, "eagle.verify", 1))
    assert path.endswith("dumps/r-1.x.step12.eagle.verify.rank1.safetensors")
    assert not list((tmp_path / "dumps").glob("*.tmp"))
    d = load_rank_dump(tmp_path / "dumps" / "r-1.x.step12.eagle.verify.rank1.safetensors")
    assert (d.run_id, d.step, d.site, d.rank, d.world_size) == ("r-1.x", 12, "eagle.verify", 1, 2)
    assert d.quantities == ["target_probs", "bonus"]
    assert d.context["probs"] == {"path": "dense", "stages": ["top_p"]}
    assert d.context["coins"] == {"draw": "torch.rand", "shapes": [[1, 5]]}
    assert d.context["renorm"] == {"name": "torch", "source": "", "deterministic": True}
    assert d.context["versions"]["torch"] == torch.__version__
    assert set(d.entries) == {"target_probs", "bonus", "param.temperature", "param.top_k", "param.top_p",
                              "param.min_p"}
    assert d.tensor("param.top_p").tolist() == [0.8999999761581421] * 4
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        assert f.metadata()["format"] == DUMP_FORMAT and json.loads(f.metadata()["context"])["algo"] == "eagle"
