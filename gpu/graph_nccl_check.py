"""2 GPUs, NCCL: the production guard's device work, all-gather included, captured in a CUDA graph
detects a divergence planted on rank 1 after capture (with the copied result and with the
zero-copy one); and with fused heal, rank 1 ends with rank 0's decisions. Run: torchrun --nproc-per-node 2 gpu/graph_nccl_check.py OUT.json"""

import json
import os
import sys

import torch
import torch.distributed as dist

from tpguard.bench.guard import make_tensors
from tpguard.bench.timing import capture
from tpguard.device_guard import DeviceStepGuard, decisions_capacity


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    results = {}

    def planted(zero_copy: bool, key: str) -> None:
        """Clean replay, then one ulp planted on rank 1 after capture: named at the next replay."""
        tt = make_tensors(32, 8, 163840, dev)
        guard = DeviceStepGuard(site="graph.nccl", run_id="graphcheck", watchdog=False,
                                trace=os.environ.get("TRACE_DIR") if not zero_copy else None)
        guard.prepare_graph(tt, zero_copy=zero_copy)
        results[f"{key}used"] = guard._graph["zero_copy"]
        graph = capture(guard.device_check)
        graph.replay()
        results[f"{key}clean"] = guard.collect() is None
        if rank == 1:
            x = tt["target_probs"].view(-1)
            x[777] = torch.nextafter(x[777], torch.tensor(2.0, device=dev))
        graph.replay()
        div = guard.collect()
        results[f"{key}planted"] = None if div is None else [div.quantity, div.culprit_ranks, div.step]
        guard.close()

    planted(False, "")
    planted(True, "zero_copy_")  # the comparison writing straight into pinned memory
    t = make_tensors(32, 8, 163840, dev)
    heal = DeviceStepGuard(site="graph.heal", policy="heal", run_id="graphcheck", watchdog=False,
                           heal_capacity=decisions_capacity(32, 8))
    d = {n: t[n] for n in ("seq_lens", "coins", "accept_index", "accept_len", "bonus", "commit_lens", "out_tokens")}
    heal.prepare_graph(d)
    graph = capture(heal.device_check)
    want = t["bonus"].clone()  # rank 0's value: make_tensors is identical on both ranks
    if rank == 1:
        t["bonus"][3] += 1
    graph.replay()
    div = heal.collect()
    results["heal_divergence"] = None if div is None else [div.quantity, div.action]
    gathered = [torch.empty_like(t["bonus"]) for _ in range(2)]
    dist.all_gather(gathered, t["bonus"])
    results["heal_bonus_equal_after"] = bool(torch.equal(gathered[0], gathered[1]))
    results["heal_bonus_is_rank0s"] = bool(torch.equal(t["bonus"], want))  # not just equal: rank 0's
    heal.close()
    named = [results[k] for k in ("planted", "zero_copy_planted")]
    results["pass"] = (results["clean"] and results["zero_copy_clean"] and results["zero_copy_used"]
                       and all(p is not None and p[:2] == ["target_probs", [1]] for p in named)
                       and results["heal_bonus_equal_after"] and results["heal_bonus_is_rank0s"])
    if rank == 0:
        print(json.dumps(results))
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(results, f)
    torch.cuda.synchronize()
    dist.barrier()
    # Tearing down NCCL communicators used inside captured graphs can block at exit: leave now.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
