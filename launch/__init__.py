"""tpguard's TP harness (`python -m tpguard.launch`, `tpguard launch`; docs/harness.md).

options (arguments and checks) -> __main__ (rendezvous, signals, process group, exit code) -> harness
(one rank's run):
workload (seeded multi-turn streams, per-rank state and prefix cache) -> state_collective (the
collective whose count depends on that state) -> pipeline (the verify step in SGLang's order:
model, the renorm from tpguard/renorm_registry.py, accept over a tree) with inject (faults) -> the guard ->
summary.
runner (`tpguard launch`: the ranks, their end, the one line), spawn (local ranks with torchrun's
environment, for `tpguard demo` (tpguard/commands/demo.py: the harness, then diagnose) and tests).
"""
