"""The direct launches' recorded templates (kernels/direct_launch.py) on CPU, with a stand-in for a
compiled kernel and its launcher: Triton's CUDA launcher cannot be loaded without a driver, so the
real one runs only in the GPU tests (tests/test_renorm_plan.py::test_direct_launches_on_gpu, the
fingerprint GPU check). Checked here: what each template slot holds after recording, the trims
(addresses for tensors, no hook chains, the C launch's 4 extra leading values), the substitution of
the roles per call, ``TPGUARD_LAUNCH_TRIM=0``, `c_launch`'s refusals, `LaunchSet.accepts` and
`LaunchSet.launch_if_accepted`."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from tpguard.kernels import direct_launch as dl

PROBS, OUT, K = range(3)
PARAMS = ("probs", "ws", "out", "k_val", "BLOCK")


class StandInLauncher:
    """Shaped like Triton 3.6's CudaLauncher: `launch` is the C function, which gets the grid, the
    stream, the function, then 4 values of the launcher's own, then what `__call__` was given."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(("c",) + args)

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.calls.append(("py", gx, gy, gz, stream, function) + args)


class StandInCompiled:
    hash = "h0"

    def __init__(self):
        self._run = StandInLauncher()

    @property
    def run(self):
        return self._run


class StandInKernel:
    """``kernel[grid](*args, **meta)`` as Triton's JIT calls the compiled launcher: grid x3, stream,
    function, packed metadata, launch metadata, enter hook, exit hook, one value per parameter."""

    def __init__(self):
        P = inspect.Parameter
        self.signature = inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD) for n in PARAMS])
        self.fn = SimpleNamespace(__name__="stand_in")
        self.compiled = StandInCompiled()

    def __getitem__(self, grid):
        def launch(*args, **meta):
            enter, exit_ = dl.launch_hooks()
            values = list(args) + [meta[n] for n in PARAMS[len(args):]]
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            self.compiled.run(*grid3, dl.current_stream(), 1234, (4, 1, 0), "launch metadata", enter, exit_,
                              *values)
            return self.compiled
        return launch


@pytest.fixture
def recorded(monkeypatch):
    """A LaunchSet recorded from one stand-in launch, with CPU tensors taken for device ones."""
    monkeypatch.setattr(dl, "current_stream", lambda: 77)
    monkeypatch.setattr(dl, "_device_tensor", lambda t: True)

    def record(trim: bool, c_launch_ok: bool):
        monkeypatch.setenv("TPGUARD_LAUNCH_TRIM", "1" if trim else "0")  # read at record time
        monkeypatch.setitem(dl._C_LAUNCH_OK, StandInLauncher, c_launch_ok)
        kernel = StandInKernel()
        probs, ws, out = torch.zeros(8), torch.zeros(4), torch.zeros(8)
        captured = [dl.Captured(kernel, (3,), (probs, ws, out, 40), {"BLOCK": 16}, kernel.compiled)]
        launches = dl.LaunchSet.record(captured, [], [probs, out, 40], (PROBS, OUT), {"k_val": K})
        assert not isinstance(launches, str), launches
        return launches, kernel.compiled._run, ws

    return record


def test_trimmed_template_calls_the_c_launch_with_addresses(recorded):
    launches, launcher, ws = recorded(trim=True, c_launch_ok=True)
    (launch,) = launches.launches
    assert launch.run == launcher.launch and launch.keep == [ws]
    assert not any(isinstance(a, torch.Tensor) for a in launch.template)
    assert launch.hooks == dl.launch_hooks()  # kept for the per-call hooks_idle check, not called
    probs, out = torch.zeros(8), torch.zeros(8)
    assert launches.accepts([probs, out, 41])
    launches([probs, out, 41])
    assert launcher.calls[-1] == ("c", 3, 1, 1, 77, 1234, False, True, None, None, (4, 1, 0), "launch metadata",
                                  None, None, probs.data_ptr(), ws.data_ptr(), out.data_ptr(), 41, 16)


def test_trimmed_template_without_the_c_launch(recorded):
    launches, launcher, ws = recorded(trim=True, c_launch_ok=False)
    probs, out = torch.zeros(8), torch.zeros(8)
    launches([probs, out, 5])
    assert launcher.calls[-1] == ("py", 3, 1, 1, 77, 1234, (4, 1, 0), "launch metadata", None, None,
                                  probs.data_ptr(), ws.data_ptr(), out.data_ptr(), 5, 16)


def test_untrimmed_template_is_what_triton_passed(recorded):
    launches, launcher, ws = recorded(trim=False, c_launch_ok=True)
    (launch,) = launches.launches
    assert launch.run is launcher and launch.variant.endswith(":as-is")
    probs, out = torch.zeros(8), torch.zeros(8)
    launches([probs, out, 5])
    call = launcher.calls[-1]
    assert call[:8] == ("py", 3, 1, 1, 77, 1234, (4, 1, 0), "launch metadata")
    assert call[8:10] == dl.launch_hooks()
    assert call[10] is probs and call[11] is ws and call[12] is out and call[13:] == (5, 16)


def test_accepts_refuses_what_the_launch_was_not_recorded_for(recorded, monkeypatch):
    launches, _, _ = recorded(trim=True, c_launch_ok=True)
    off = torch.zeros(9)[1:]  # 4 bytes off the recorded 16-byte alignment
    assert not launches.accepts([off, torch.zeros(8), 40])
    assert not launches.accepts([torch.zeros(8), torch.zeros(8), 1])  # k == 1: another specialisation
    monkeypatch.setattr(dl, "_device_tensor", lambda t: t.is_cuda)
    assert not launches.accepts([torch.zeros(8), torch.zeros(8), 40])  # a host tensor: Triton's launch


@pytest.mark.parametrize("trim", [True, False])
def test_launch_if_accepted_is_accepts_then_the_launch(recorded, monkeypatch, trim):
    # one read of each address for the check and the launch: the same launcher call as `accepts` + `__call__`
    launches, launcher, ws = recorded(trim=trim, c_launch_ok=True)
    probs, out = torch.zeros(8), torch.zeros(8)
    launches([probs, out, 41])
    expect = launcher.calls.pop()
    assert launches.launch_if_accepted([probs, out, 41])
    assert launcher.calls.pop() == expect and not launcher.calls
    assert launches.addresses([probs, out, 41])[:2] == [probs.data_ptr(), out.data_ptr()]
    off = torch.zeros(9)[1:]
    for refused in ([off, out, 41], [probs, off, 41], [probs, out, 1], [probs, out, 32]):
        assert not launches.accepts(refused)
        assert not launches.launch_if_accepted(refused) and not launcher.calls
    monkeypatch.setattr(dl, "_device_tensor", lambda t: t.is_cuda)
    assert not launches.launch_if_accepted([probs, out, 41]) and not launcher.calls


def test_c_launch_only_for_the_launcher_it_was_read_from(monkeypatch):
    assert dl.c_launch(StandInLauncher()) is None  # its __call__ is not Triton 3.6.0's
    monkeypatch.setitem(dl._C_LAUNCH_OK, StandInLauncher, True)
    launcher = StandInLauncher()
    assert dl.c_launch(launcher) == (launcher.launch, (False, True, None, None))
    launcher.global_scratch_size = 64  # scratch: __call__ allocates it per launch
    assert dl.c_launch(launcher) is None


def test_one_tensor_in_two_roles_is_refused(monkeypatch):
    # a later call may pass two tensors there, and one template slot cannot take both
    monkeypatch.setattr(dl, "current_stream", lambda: 77)
    monkeypatch.setattr(dl, "_device_tensor", lambda t: True)
    kernel = StandInKernel()
    probs, ws = torch.zeros(8), torch.zeros(4)
    captured = [dl.Captured(kernel, (3,), (probs, ws, probs, 40), {"BLOCK": 16}, kernel.compiled)]
    refusal = dl.LaunchSet.record(captured, [], [probs, probs, 40], (PROBS, OUT), {"k_val": K})
    assert refusal == "stand_in: one tensor passed in two roles"


def test_hooks_idle_only_while_no_hook_is_added_or_swapped():
    # a profiler adds a launch hook (or replaces the chain): recorded templates then stop being used
    enter, exit_ = dl.launch_hooks()
    assert dl.hooks_idle(enter, exit_)
    for chain in (enter, exit_):
        def hook(*_):
            return None

        chain.add(hook)
        try:
            assert not dl.hooks_idle(enter, exit_)
        finally:
            chain.remove(hook)
        assert dl.hooks_idle(enter, exit_)
    assert not dl.hooks_idle(object(), exit_)  # not the chain Triton calls now
