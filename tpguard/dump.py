"""Dumps: each rank's tensors of a divergent step, and what `tpguard replay` needs to re-run it.

One safetensors file per rank, step and site, written atomically (a temporary file, then a rename):

    <trace dir>/dumps/<run id>.step<step>.<site>.rank<rank>.safetensors

Tensors: each recorded quantity under its own name (the value the rank recorded, before any heal),
plus, when the writer knows them, the per-row sampling parameters of the renorm stage
(``param.temperature``, ``param.top_k`` (0: off), ``param.top_p``, ``param.min_p``: one value per
row of ``target_probs``). Metadata (strings): ``format``, ``run_id``, ``step``, ``site``, ``rank``,
``world_size``, ``quantities`` (JSON list, causal order) and ``context`` (JSON, a `DumpContext`):
the algorithm and draft tree, how ``target_probs`` was made from ``target_logits``, the renorm
backend with versions, how the coins were drawn, the accept thresholds. docs/replay.md lists the
fields; the harness (launch/harness.py) and the SGLang plugin write them through `write_dump`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

DUMP_FORMAT = "tpguard.dump/1"
DUMPS_SUBDIR = "dumps"
PARAM_PREFIX = "param."
PARAM_NAMES = ("temperature", "top_k", "top_p", "min_p")
RENORM_STAGES = ("top_k", "top_p", "min_p")  # the order the dense verify path applies them in


def dumps_dir(trace_dir: str | os.PathLike | None) -> Path:
    """Where dumps of a trace directory go (the harness's `--dump`, the plugin's TPGUARD_DUMP)."""
    return Path(trace_dir or ".") / DUMPS_SUBDIR


def dump_name(run_id: str, step: int, site: str, rank: int) -> str:
    return f"{run_id}.step{int(step)}.{site}.rank{int(rank)}.safetensors"


@dataclass
class DumpContext:
    """What re-running the step needs beyond the recorded tensors (JSON in the dump's metadata).

    algo: "dflash" (chain accept) or "eagle" (tree accept), or another site's algorithm;
    tree_parents: per request, each node's parent (node 0, the root, has -1), nodes in order;
    probs: how target_probs came from target_logits: {"path": "dense", "stages": [...]}:
      softmax(logits / temperature) in float32, then the renorm stages in order (top_k, top_p,
      min_p), each called on all rows with the per-row parameters;
    renorm: {"name": an implementation's name in the renorm registry (tpguard/renorm_registry.py), "source",
      "deterministic"};
    coins: {"draw": "torch.rand", "shapes": [[...], ...]} when the coins are the first draws of
      the generator whose state is `rng_state` (one `torch.rand` per shape, in order; the
      recorded coins are their values in that order), else {};
    accept: {"threshold_single", "threshold_acc"}, the coins' layout
      ("coins": [bs, nodes + 1], the last column the bonus coin);
    device: where the step ran ("cpu", "cuda"); versions: torch, tpguard, triton, flashinfer,
      sglang, CUDA and the device's name.
    """

    algo: str
    tree_parents: list[int] | None = None
    probs: dict = field(default_factory=dict)
    renorm: dict = field(default_factory=dict)
    coins: dict = field(default_factory=dict)
    accept: dict = field(default_factory=dict)
    device: str = "cpu"
    versions: dict = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # written as tensors, not metadata

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("params")
        return d


def renorm_stages(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> list[str]:
    """The renorm stages the harness's batch needs: any row asking for it (top_k 0 is off)."""
    on = {"top_k": bool((top_k > 0).any()), "top_p": bool((top_p < 1).any()), "min_p": bool((min_p > 0).any())}
    return [k for k in RENORM_STAGES if on[k]]


def sampling_params(temperature, top_k, top_p, min_p, rows_per_request: int = 1) -> dict[str, torch.Tensor]:
    """Per-row parameter tensors (CPU) from per-request values (arrays, lists or tensors; SGLang's
    [bs, 1] `temperatures` included), repeated `rows_per_request` times (the verify positions):
    float32 temperature, top_p, min_p; int64 top_k as the renorm was given it, except 0, which
    means off (the harness's convention; replay passes the vocabulary size for it)."""
    import torch

    def rows(x, dtype):
        t = torch.as_tensor(x).detach().reshape(-1).to("cpu", dtype)
        return t.repeat_interleave(rows_per_request) if rows_per_request > 1 else t.clone()

    return {"temperature": rows(temperature, torch.float32), "top_k": rows(top_k, torch.int64),
            "top_p": rows(top_p, torch.float32), "min_p": rows(min_p, torch.float32)}


def context_from_sampling_info(sampling_info, draft_token_num: int, *, algo: str, renorm_name: str,
                               renorm_source: str = "", deterministic: bool | None = None,
                               tree_parents=None, sparse_topk: bool = False, coins_shapes=None,
                               stages: list[str] | None = None, device: str = "cuda") -> DumpContext:
    """The context of an SGLang verify step, for the plugin's dumps: `sampling_info` is SGLang's
    SamplingBatchInfo (temperatures, top_ks, top_ps, min_ps, need_*_sampling), `draft_token_num`
    the verify positions per request (the rows of target_probs per request); `renorm_name` a
    renorm registry name (flashinfer, flashinfer-det, tpguard, torch); `sparse_topk` whether
    `build_speculative_verify_target_probs` took its sparse top-k path (replay re-runs the dense
    one only); `tree_parents` per request (None: a chain of `draft_token_num` nodes); `stages`
    default: top_k then top_p as SamplingBatchInfo's need_* flags say (the stages
    `build_speculative_verify_target_probs` applies; it has no min-p stage)."""
    params = sampling_params(sampling_info.temperatures, sampling_info.top_ks, sampling_info.top_ps,
                             sampling_info.min_ps, draft_token_num)
    if stages is None:
        need = {"top_k": bool(getattr(sampling_info, "need_top_k_sampling", True)),
                "top_p": bool(getattr(sampling_info, "need_top_p_sampling", False))}
        stages = [k for k in ("top_k", "top_p") if need[k]]
    parents = list(tree_parents) if tree_parents is not None else [-1] + list(range(draft_token_num - 1))
    ctx = make_context(algo, tree_parents=parents, renorm_name=renorm_name, renorm_source=renorm_source,
                       deterministic=deterministic, params=params, stages=stages, coins_shapes=coins_shapes,
                       device=device)
    if sparse_topk:
        ctx.probs["path"] = "sparse_topk"
    return ctx


def runtime_versions(device: str = "cpu") -> dict:
    """Versions a replay must match to reproduce bytes: tpguard, torch, triton, flashinfer,
    sglang (those imported), CUDA and the device's name."""
    import torch

    import tpguard

    versions = {"tpguard": tpguard.__version__, "torch": torch.__version__}
    for name in ("triton", "flashinfer", "sglang"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    if device.startswith("cuda") and torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
        versions["device_name"] = torch.cuda.get_device_name()
    return versions


def make_context(algo: str, *, tree_parents=None, renorm_name: str, renorm_source: str = "",
                 deterministic: bool | None = None, params: dict[str, torch.Tensor] | None = None,
                 stages: list[str] | None = None, coins_shapes=None, threshold_single: float = 1.0,
                 threshold_acc: float = 1.0, device: str = "cpu") -> DumpContext:
    """A `DumpContext` from plain values: what the harness writes and what the SGLang plugin can
    call at its verify site (`params` from `sampling_params`; `stages` default: `renorm_stages`
    of the params; `coins_shapes` only when the coins are the first `torch.rand` draws after
    `rng_state`, one shape per draw)."""
    params = params or {}
    if stages is None and params:
        stages = renorm_stages(params["top_k"], params["top_p"], params["min_p"])
    return DumpContext(
        algo=algo, tree_parents=list(tree_parents) if tree_parents is not None else None,
        probs={"path": "dense", "stages": list(stages or [])},
        renorm={"name": renorm_name, "source": renorm_source, "deterministic": deterministic},
        coins=({"draw": "torch.rand", "shapes": [[int(x) for x in shape] for shape in coins_shapes]}
               if coins_shapes else {}),
        accept={"threshold_single": float(threshold_single), "threshold_acc": float(threshold_acc)},
        device=device, versions=runtime_versions(device), params=params)


def write_dump(directory: str | os.PathLike, *, run_id: str, step: int, site: str, rank: int, world_size: int,
               quantities, tensors: dict[str, torch.Tensor], context: DumpContext | None = None) -> str:
    """Save one rank's tensors of one step atomically; returns the file's path."""
    from tpguard.optional import require

    require("safetensors", "dumps")
    from safetensors.torch import save_file

    path = Path(directory) / dump_name(run_id, step, site, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}
    meta = {"format": DUMP_FORMAT, "run_id": run_id, "step": str(int(step)), "site": site,
            "rank": str(int(rank)), "world_size": str(int(world_size)), "quantities": orjson.dumps(list(quantities)).decode()}
    if context is not None:
        for name, t in context.params.items():
            out[PARAM_PREFIX + name] = t.detach().contiguous().cpu().clone()
        meta["context"] = orjson.dumps(context.to_json(), option=orjson.OPT_NON_STR_KEYS).decode()
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return str(path)
