"""Running real sglang code on 2 gloo ranks, fast: a "zygote" process imports sglang once (it
takes ~10 s) and forks the ranks of each scenario from there.

A test file defines its scenarios (functions run on every rank with the real TP group) in
SCENARIOS, with PRELOAD (the modules its zygote imports), PLAIN (one-process functions) and
SERVER_ARGS, and runs them on the zygote its pytest worker shares with the other sglang test files
(conftest.py's `shared_zygote` fixture: `shared_zygote().load(__file__, PLAIN)`). A file whose
PRELOAD changes what sglang imports (the UNO tests' flashinfer stand-in) has a zygote of its own:

    if __name__ == "__main__" and "--zygote" in sys.argv:
        sglang_zygote.zygote_main(PRELOAD, SCENARIOS, PLAIN, SERVER_ARGS)

and `Zygote(__file__, PLAIN)`. Each rank loads tpguard through sglang's own `load_plugins()` (as a
scheduler process does), then builds sglang's TP group over gloo.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

# The scenarios are CPU tests (gloo, CPU tensors), on a GPU machine too: no GPU for sglang, whose
# CUDA paths import its compiled kernels, and sglang's Triton kernels under the interpreter
# (TRITON_INTERPRET must be set before triton is imported: sglang imports it).
ZYGOTE_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "SGLANG_PLUGINS": "tpguard",
              "PYTHONWARNINGS": "ignore"}
CLEARED = ("TPGUARD", "SGLANG_SPEC_TP_SYNC")  # prefixes a scenario's env starts without


def missing() -> str | None:
    """Why real sglang cannot run here with tpguard's plugin (a module-level skip), or None."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = None
    if found != "0.5.23":
        return f"sglang 0.5.23 is not installed (found: {found}; scripts/setup.sh)"
    if not any(ep.name == "tpguard" for ep in entry_points(group="sglang.srt.plugins")):
        return "tpguard is not installed (pip install -e .): sglang's load_plugins() finds it by its entry point"
    return None


def count_collectives() -> dict:
    """Count collectives from here on, in a rank (instrumentation of the real torch.distributed
    functions, which still run): "n" gathers (the guard's), "broadcast" tensor broadcasts
    (sglang's rank-0 syncs and tpguard's heal)."""
    import torch.distributed as dist

    counts = {"n": 0, "broadcast": 0}
    for name in ("all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast_object_list",
                 "broadcast"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        key = "broadcast" if name == "broadcast" else "n"

        def counted(*a, _fn=fn, _key=key, **k):
            counts[_key] += 1
            return _fn(*a, **k)

        setattr(dist, name, counted)
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(name: str, rank: int, world: int, port: int, out_path: str, scenarios: dict,
               plain: dict, server_args: dict | None) -> None:
    result = {"ok": False}
    try:
        if name in plain:
            result = {"ok": True, "value": plain[name]()}
            return
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import get_context, get_parallel

        # As sglang does first thing in a scheduler process. The plugin hooks only processes whose
        # load_plugins() call comes from sglang's run_scheduler_process; these ranks stand in for
        # scheduler processes, so they say so as a script would (test_sglang_processes.py drives
        # the real entry functions of each kind of process).
        os.environ.setdefault("TPGUARD_ALL_PROCESSES", "1")
        setup = getattr(scenarios[name], "before_plugins", None)
        if setup is not None:  # e.g. stand in for a newer sglang whose function changed
            setup(rank)
        load_plugins()
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=60)
        tp = ps.init_model_parallel_group([list(range(world))], rank, "gloo", use_pynccl=False,
                                          use_custom_allreduce=False, group_name="tp")
        get_parallel().override_permanently(tp_group=tp, attn_dp_enabled=False)
        if server_args:
            get_context().override_server_args(**server_args, tp_size=world).install()
        result = {"ok": True, "value": scenarios[name](rank, world, tp)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        try:
            from tpguard.hooks import sglang_runtime

            if sglang_runtime.RUNTIME is not None:
                sglang_runtime.RUNTIME.close_all()
        except Exception:
            pass
        with open(out_path, "w") as f:
            json.dump(result, f)


def _fork_scenario(req: dict, scenarios: dict, plain: dict, server_args: dict | None) -> dict:
    world, name, timeout = req.get("world", 2), req["scenario"], req.get("timeout", 60)
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="tpguard-sg-")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                os.dup2(2, 1)  # stray prints must not reach the zygote's answer pipe
                for k in [k for k in os.environ if k.startswith(CLEARED)]:
                    del os.environ[k]
                os.environ.update(req.get("env", {}))
                os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
                _rank_main(name, rank, world, port, os.path.join(tmp, f"{rank}.json"), scenarios, plain,
                           server_args)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
        time.sleep(0.02)
    for pid in alive:  # only the ranks this zygote forked
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    results = []
    for rank in range(world):
        path = os.path.join(tmp, f"{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({"ok": False, "error": "rank timed out or died", "traceback": ""})
    return {"results": results}


def _begin() -> object:
    """The zygote's start: its answer channel (a private copy of stdout), the interpreter's speed-up."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed lands on stderr
    if os.environ.get("TRITON_INTERPRET") == "1":  # sglang's and tpguard's kernels in the ranks
        import triton_interpreter

        triton_interpreter.speed_up()
    return out


def _serve(out, answer: Callable[[dict], dict]) -> None:
    """One JSON request per stdin line, one answer each; then the end."""
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(json.loads(line))
        except Exception as e:  # noqa: BLE001
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    # Nothing here needs tearing down: a normal exit would spend ~2.5 s of CPU collecting sglang's
    # modules, so the zygote ends at once (its answers are flushed, its ranks waited for).
    out.close()
    sys.stderr.flush()
    os._exit(0)


def zygote_main(preload: tuple[str, ...], scenarios: dict[str, Callable], plain: dict[str, Callable],
                server_args: dict | None = None) -> None:
    """A test file's own zygote (`python TEST_FILE --zygote`): import `preload` once, then serve."""
    out = _begin()
    for mod in preload:
        importlib.import_module(mod)
    _serve(out, lambda req: _fork_scenario(req, scenarios, plain, server_args))


def shared_main() -> None:
    """The zygote test files share (SharedZygote): {"load": FILE} imports that test file as a module,
    then its PRELOAD, here once; a scenario request names its file. A file's scenarios run as on a
    zygote of its own, with the other files' modules imported too (sglang's and tpguard's, which a
    rank imports anyway when its plugin loads)."""
    out = _begin()
    programs = {}

    def answer(req: dict) -> dict:
        if "load" in req:
            module = importlib.import_module(os.path.splitext(os.path.basename(req["load"]))[0])
            for mod in module.PRELOAD:
                importlib.import_module(mod)
            programs[req["load"]] = (module.SCENARIOS, getattr(module, "PLAIN", {}),
                                     getattr(module, "SERVER_ARGS", None))
            return {"loaded": req["load"]}
        return _fork_scenario(req, *programs[req["file"]])

    _serve(out, answer)


class Zygote:
    """The test side: starts a zygote (by default `python TEST_FILE --zygote`) and runs scenarios on it."""

    def __init__(self, test_file: str, plain_names=(), start_timeout: float = 300.0, argv=None):
        self.plain_names = set(plain_names)
        self.file = None  # (a shared zygote's view names its file in each request)
        test_file = os.path.abspath(test_file)
        tests = os.path.dirname(test_file)
        env = {k: v for k, v in os.environ.items() if not k.startswith(CLEARED)}
        env.update(ZYGOTE_ENV)
        env["PYTHONPATH"] = os.pathsep.join([tests, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(argv or [sys.executable, test_file, "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True, env=env,
                                     cwd=os.path.dirname(tests))
        line = self._readline(start_timeout)
        if not line or not json.loads(line).get("ready"):
            self.close()
            raise RuntimeError("the sglang zygote did not start (see stderr above)")

    def _readline(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    def _ask(self, req: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self._readline(timeout)
        if not line:  # a late answer would be taken for the next request's: no more requests
            self.proc.kill()
        assert line, f"zygote gave no answer to {req}"
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply

    def run(self, scenario: str, env: dict | None = None, world: int = 2, timeout: float = 60.0) -> list:
        if scenario in self.plain_names:
            world = 1
        req = {"scenario": scenario, "env": env or {}, "world": world, "timeout": timeout}
        if self.file:
            req["file"] = self.file
        reply = self._ask(req, timeout + 30)
        for rank, r in enumerate(reply["results"]):
            assert r["ok"], f"rank {rank} of {scenario}: {r['error']}\n{r.get('traceback', '')}"
        return [r["value"] for r in reply["results"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class SharedZygote(Zygote):
    """One sglang import for several test files (conftest.py's `shared_zygote` fixture: one per
    pytest worker): each file loads its scenarios once, then runs them through its own view."""

    def __init__(self, start_timeout: float = 300.0):
        super().__init__(__file__, (), start_timeout,
                         argv=[sys.executable, "-c", "import sglang_zygote; sglang_zygote.shared_main()"])

    def load(self, test_file: str, plain_names=(), timeout: float = 300.0) -> Zygote:
        test_file = os.path.abspath(test_file)
        self._ask({"load": test_file}, timeout)
        view = Zygote.__new__(Zygote)  # (the running process, this file's requests)
        view.proc, view.plain_names, view.file = self.proc, set(plain_names), test_file
        return view


# --- helpers for scenarios (they run in a rank, after load_plugins) ---------------------------

def sampling_info(bs: int, vocab: int, *, greedy: bool = False, top_p: float = 1.0,
                  top_k: int | None = None, min_p: float = 0.0, temperature: float = 0.8):
    """A real SamplingBatchInfo on CPU."""
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.full((bs, 1), 1.0 if greedy else temperature), top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), 1 if greedy else (top_k or vocab), dtype=torch.int32),
        min_ps=torch.full((bs,), min_p), is_all_greedy=greedy, is_any_greedy=greedy,
        need_top_p_sampling=top_p < 1.0, need_top_k_sampling=top_k is not None,
        need_min_p_sampling=min_p > 0, vocab_size=vocab, device="cpu",
    )


def logits(step: int, rows: int, vocab: int, scale: float = 3.0):
    """Seeded logits, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn((rows, vocab), generator=g) * scale


def divergence_log(site: str) -> list:
    """Divergences the plugin's guard of `site` reports on this rank: [step, site, quantity,
    culprits, action, healed]. Creates the site's guard now (and so resolves its group)."""
    from tpguard.hooks import sglang_runtime

    log = []
    if sglang_runtime.RUNTIME is not None:
        sglang_runtime.RUNTIME.guard(site).listeners.append(
            lambda d: log.append([d.step, d.site, d.quantity, d.culprit_ranks, d.action, d.healed]))
    return log


def plugin_stats() -> dict:
    from tpguard.hooks import sglang_plugin

    return sglang_plugin.stats()
