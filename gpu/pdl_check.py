"""Offline check (no GPU): every PDL kernel of the renorms waits before it touches memory.

`RenormConfig.pdl` (kernels/pdl.py) is exact only if each dependent launch executes
``griddepcontrol.wait`` before its first global load or store (the write pass may load the call's
input before it, never store). That order is the compiler's to keep: this module compiles each
launch of each op for sm_90a, as the launch code makes it (the same kernels, constexprs and launch
options, recorded from the real host path with `JITFunction.run` replaced by a recorder), and
reads the SASS: ``ACQBULK`` is the wait, ``PREEXIT`` the signal to dependents.

Checks per call: its first launch is plain (FIRST), every later one a dependent with the PDL
attribute. Per compiled launch (its PDL constexpr): FIRST: a signal, no wait; DEPENDENT:
launched with the PDL attribute, an unpredicated wait with no branch before it, before every global
memory instruction (the write pass: before every store, and its five 32-bit parameter loads after
it), and a signal. Cases: every op, scalar and per-row parameters, with and without the fingerprint
slot, vocab 163840 and 151937 (not a multiple of 16), at the default RenormConfig, 256 rows (and top-k at
64 rows of 163840, which takes PDL from 64 rows on long rows); Triton's specialisation of the arguments
(16-byte pointers, ints == 1 and % 16) is rebuilt from the values.

Usage (a process without TRITON_INTERPRET, exit code 2 otherwise; Triton's bundled ptxas and nvdisasm):
    python gpu/pdl_check.py [--ops top_p,top_k,...]
    python gpu/pdl_check.py --self-test   # only: the check fails a kernel that loads before its wait
Every run starts with the self-test (a check that passes everything would prove nothing), prints one
line per distinct compiled launch and exits 1 if any check fails (tests/test_pdl.py runs it).
Compiled kernels come from Triton's cache, and so does their SASS (keyed by the cubin's bytes and
the nvdisasm binary): a second run skips nvdisasm's start-up, about 0.3 s per kernel.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.cache import get_cache_manager
from triton.runtime.jit import JITFunction

from tpguard.config import interpreting
from tpguard.kernels.pdl import pdl_enter

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# global (and generic) memory instructions, SASS opcode prefixes; shared-memory ones are not
MEMORY = ("LDG", "STG", "ATOM", "RED.", "LDGSTS", "ST.", "LD.", "UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "CCTL")
SHARED = ("LDS", "STS", "LDSM", "ATOMS")
_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.int32: "*i32", torch.int64: "*i64",
          torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.uint8: "*u8", torch.int16: "*i16"}


def record_launches(op: str, mode: int, vocab: int = 163840, tensor_params: bool = False,
                    fingerprint: bool = False, rows: int = 256) -> list:
    """(kernel, args, kwargs) of every launch one call of `op` makes with RenormConfig.pdl = mode,
    recorded from the host code (no launch, no GPU: CPU tensors stand in)."""
    from tpguard.kernels import pdl, renorm_plan
    from tpguard.kernels.renorm_config import default_config

    calls = []
    real_run, real_supported = JITFunction.run, pdl.supported
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: calls.append((self, args, kwargs))
    pdl.supported = lambda device: True  # as on an H200 (this process runs without TRITON_INTERPRET)
    try:
        cfg = default_config().replace(pdl=mode, pdl_min_rows=1)
        x = _input(rows, vocab)
        k = torch.full((rows,), 40, dtype=torch.int32) if tensor_params else 40
        p = torch.full((rows,), 0.9) if tensor_params else 0.9
        slot = torch.zeros((), dtype=torch.int64) if fingerprint else None
        kk = k if op in ("top_k", "top_k_top_p") else None
        pp = (p if op != "min_p" else (torch.full((rows,), 0.1) if tensor_params else 0.1)) if op != "top_k" else None
        renorm_plan._run_op(op, x, kk, pp, cfg, slot, None)
    finally:
        JITFunction.run, pdl.supported = real_run, real_supported
    return calls


_INPUTS: dict = {}


def _input(rows: int, vocab: int) -> torch.Tensor:
    """The probs a recorded call gets, one per shape (nothing launches: the host code only reads it)."""
    if (rows, vocab) not in _INPUTS:
        _INPUTS[rows, vocab] = torch.rand(rows, vocab)
    return _INPUTS[rows, vocab]


def _signature(kernel, args, kwargs) -> tuple[dict, dict, dict, list]:
    """(signature, constexprs, options, 16-divisible argument indices) of a recorded launch, as Triton
    specialises it: pointers 16-byte aligned (as a fresh allocation is), an int equal to 1 a constant,
    an int divisible by 16 marked so (not for `do_not_specialize` parameters)."""
    params = kernel.params
    sig, const, aligned = {}, {}, []
    values = dict(zip([p.name for p in params], args))
    values.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    plain = {params[i].name if isinstance(i, int) else i for i in getattr(kernel, "do_not_specialize", ())}
    for i, p in enumerate(params):
        v = values[p.name] if p.name in values else p.default
        if p.is_constexpr or v is None or (type(v) is int and v == 1 and p.name not in plain):
            sig[p.name] = "constexpr"
            const[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _TYPES[v.dtype]
            aligned.append(i)
        elif isinstance(v, bool):
            sig[p.name] = "u1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(1 << 31) <= v < (1 << 31) else "i64"
            if v % 16 == 0 and p.name not in plain:
                aligned.append(i)
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}.{p.name}: {type(v).__name__}")
    opts = {k: kwargs[k] for k in ("num_warps", "maxnreg", "launch_pdl") if k in kwargs}
    return sig, const, opts, aligned


def sass_of(kernel, sig, const, opts, aligned) -> tuple[str, bool]:
    """(SASS text, the compiled kernel's launch_pdl) for sm_90a."""
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    cc = triton.compile(src, target=TARGET, options=opts)
    return disassemble(cc.asm["cubin"]), bool(getattr(cc.metadata, "launch_pdl", False))


def disassemble(cubin: bytes) -> str:
    """nvdisasm's SASS of a cubin. Kept in Triton's cache: the text is a function of the cubin's
    bytes and the nvdisasm binary, which make its key."""
    tool = os.path.join(BIN, "nvdisasm")
    st = os.stat(tool)
    key = hashlib.sha256(cubin + f"{tool}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    try:
        cache = get_cache_manager(key)
        path = cache.get_file("kernel.sass")
    except (OSError, RuntimeError):  # no writable cache: disassemble every time
        cache = path = None
    if path is not None:
        with open(path) as f:
            return f.read()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    if cache is not None:
        try:
            cache.put(sass, "kernel.sass", binary=False)
        except (OSError, RuntimeError):
            pass
    return sass


def opcodes(sass: str) -> list[str]:
    """The instructions' opcodes in order; a predicated one with a leading "@" ("@LDG.E")."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            out.append(("@" if m.group(1) else "") + m.group(2))
    return out


def is_memory(op: str) -> bool:
    op = op.lstrip("@")
    return op.startswith(MEMORY) and not op.startswith(SHARED)


def _is_load(op: str) -> bool:
    return op.lstrip("@").startswith(("LDG", "LD."))


def _is_scalar_load(op: str) -> bool:
    """A 32-bit global load (LDG.E, not .64 / .128): the write pass's parameter loads."""
    op = op.lstrip("@")
    return op.startswith("LDG") and not any(w in op for w in (".64", ".128", ".U8", ".S8", ".U16", ".S16"))


def check(name: str, pdl_value: int, ops: list[str], launch_pdl: bool) -> list[str]:
    """The failed checks of one compiled launch (empty: it keeps the PDL rules)."""
    from tpguard.kernels import pdl

    bad = []
    waits = [i for i, o in enumerate(ops) if o.lstrip("@") == "ACQBULK"]
    signals = [i for i, o in enumerate(ops) if o.lstrip("@") == "PREEXIT"]
    if pdl_value == pdl.FIRST:
        if waits or not signals or launch_pdl:
            bad.append("the first launch must signal, not wait, and launch plainly")
        return bad
    if not launch_pdl:
        bad.append("not launched with the PDL attribute")
    if not waits:
        return bad + ["no griddepcontrol.wait"]
    wait = waits[0]
    if ops[wait].startswith("@"):
        bad.append("the wait is predicated")
    jumps = [o for o in ops[:wait] if o.lstrip("@").startswith(("BRA", "EXIT", "JMP", "BRX", "RET", "CALL"))]
    if jumps:
        bad.append(f"control flow before the wait: {jumps[:3]}")  # (a branch could skip it)
    before = [o for o in ops[:wait] if is_memory(o)]
    if name == "_renorm_write_kernel":
        # probs may be loaded before the wait, nothing else: no store, and the 5 parameter loads (4 params,
        # the row's flag: 32-bit) after it; where probs loads are vectors, no 32-bit load before it at all
        after = [o for o in ops[wait:] if is_memory(o)]
        if any(not _is_load(o) for o in before):
            bad.append(f"stores before the wait: {before[:4]}")
        if sum(_is_scalar_load(o) for o in after) < 5:
            bad.append("the write parameters are not loaded after the wait")
        if any(not _is_scalar_load(o) for o in before + after if _is_load(o)) and any(
                _is_scalar_load(o) for o in before):
            bad.append("a 32-bit load (a write parameter) before the wait")
    elif before:
        bad.append(f"global memory before the wait: {before[:4]}")
    if not signals:
        bad.append("no signal to dependents")
    return bad


def check_sequence(launches: list) -> list[str]:
    """The order of one call's launches: the first plain (FIRST), every later one a dependent with the
    PDL attribute."""
    from tpguard.kernels import pdl

    bad = []
    for i, (kernel, _, kwargs) in enumerate(launches):
        value, attr = kwargs.get("PDL", 0), bool(kwargs.get("launch_pdl", False))
        want = pdl.FIRST if i == 0 else pdl.DEPENDENT
        if value != want or attr != (i > 0):
            bad.append(f"launch {i} {kernel.fn.__name__}: PDL={value} launch_pdl={attr}")
    return bad


@triton.jit
def _load_then_wait(x_ptr, y_ptr, PDL: tl.constexpr):
    """Self-test: a dependent kernel that loads before it waits (check() must fail it)."""
    v = tl.load(x_ptr + tl.arange(0, 128))
    pdl_enter(PDL)
    tl.store(y_ptr + tl.arange(0, 128), v)


@triton.jit
def _wait_then_load(x_ptr, y_ptr, PDL: tl.constexpr):
    """Self-test: the rule kept (check() must pass it)."""
    pdl_enter(PDL)
    tl.store(y_ptr + tl.arange(0, 128), tl.load(x_ptr + tl.arange(0, 128)))


def self_test() -> int:
    """The check on two small compiled kernels: one breaking the rule, one keeping it."""
    from tpguard.kernels import pdl

    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "PDL": "constexpr"}
    verdicts = {}
    for kernel in (_load_then_wait, _wait_then_load):
        sass, launch_pdl = sass_of(kernel, sig, {"PDL": pdl.DEPENDENT}, {"num_warps": 4, "launch_pdl": True}, [0, 1])
        verdicts[kernel.fn.__name__] = check(kernel.fn.__name__, pdl.DEPENDENT, opcodes(sass), launch_pdl)
    ok = bool(verdicts["_load_then_wait"]) and not verdicts["_wait_then_load"]
    print(f"self-test: {verdicts} -> {'ok' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


# (op, vocab, per-row parameter tensors, fingerprint slot, rows); 151937: not a multiple of 16
CASES = [c + (256,) for c in (
    ("top_p", 163840, False, False), ("top_p", 163840, True, True), ("top_k", 163840, False, False),
    ("top_k", 163840, True, False), ("top_k_top_p", 163840, False, True), ("top_k_top_p", 163840, True, False),
    ("min_p", 163840, False, False), ("min_p", 163840, True, True), ("top_p", 151937, False, True),
    ("top_k_top_p", 151937, True, False),
)] + [  # top-k on long rows takes PDL from 64 rows (RenormConfig.top_k_pdl_min_rows, renorm_config.op_config)
    ("top_k", 163840, True, False, 64), ("top_k_top_p", 163840, False, False, 64),
]


def main(argv=None) -> int:
    def ops(text: str) -> set:
        known = {c[0] for c in CASES}
        if not set(text.split(",")) <= known:
            raise argparse.ArgumentTypeError(f"ops are some of {','.join(sorted(known))}, got {text!r}")
        return set(text.split(","))

    ap = argparse.ArgumentParser(prog="gpu/pdl_check.py")
    ap.add_argument("--ops", default={c[0] for c in CASES}, type=ops, help="e.g. top_p,top_k")
    ap.add_argument("--self-test", action="store_true", help="only: the check on a kernel that breaks the rule")
    a = ap.parse_args(argv)
    if interpreting():  # the kernels must be JIT functions (compiled), not interpreted ones
        print("pdl_check: run it without TRITON_INTERPRET (it compiles for sm_90a; no GPU needed)", file=sys.stderr)
        return 2
    if a.self_test:
        return self_test()

    seen, failures = set(), self_test()
    for op, vocab, tensors, fp, rows in (c for c in CASES if c[0] in a.ops):
        launches = record_launches(op, 1, vocab, tensor_params=tensors, fingerprint=fp, rows=rows)
        order = check_sequence(launches)
        failures += bool(order)
        print(f"{op:12s} {rows} x {vocab} {'per-row' if tensors else 'scalar'} parameters"
              f"{', fingerprint slot' if fp else ''}: {len(launches)} launches, order "
              + ("ok" if not order else "FAIL " + "; ".join(order)), flush=True)
        for kernel, args, kwargs in launches:
            sig, const, opts, aligned = _signature(kernel, args, kwargs)
            key = (kernel.fn.__name__, tuple(sorted(sig.items())), repr(sorted(const.items())),
                   tuple(sorted(opts.items())), tuple(aligned))
            if key in seen:
                continue
            seen.add(key)
            pdl_value = const.get("PDL", 0)
            sass, launch_pdl = sass_of(kernel, sig, const, opts, aligned)
            bad = check(kernel.fn.__name__, pdl_value, opcodes(sass), launch_pdl) if pdl_value else \
                ["a launch without PDL under pdl=1"]
            failures += bool(bad)
            print(f"{op:12s} {kernel.fn.__name__:26s} PDL={pdl_value} launch_pdl={launch_pdl}: "
                  + ("ok" if not bad else "FAIL " + "; ".join(bad)), flush=True)
    print(f"{len(seen)} compiled launches, {failures} failing", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
