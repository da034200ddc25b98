"""Compile kernels for sm_90a without a GPU and count what ptxas made of them (registers, stack,
SASS instructions by opcode, barriers, layout conversions). Counts, not timings: how the numbers in
kernels/NOTES.md ("Session 3 variants", "bracket_copy=2") and NOTES-fingerprint.md sections 5-6 were
obtained. The GPU machine runs Triton 3.6.0: put a copy of it first on PYTHONPATH, e.g.

    pip install --no-deps --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36 python kernels/offline_sass.py fingerprint 0 10 15
    PYTHONPATH=/tmp/tri36 python kernels/offline_sass.py bracket 0 2

`fingerprint SHIFTS...`: `_rows_kernel` at the default tile ([8, 512] x 4 warps, maxnreg 128),
256 x 163840 fp32, with the launch's divisibility-16 specialisation; per 32-bit word of its main
loop: instructions on the integer ALU pipe (SHF, LOP3, IADD3) and on the FMA pipe (IMAD, VIADD).
`knobs [NAME=VALUE,...]...`: the same kernel for 256 x 163840 fp32 at the default KernelConfig with
each override (e.g. ``shifts=1``, ``block_words=2048,maxnreg=none``; "" the default): registers, stack, dynamic shared memory, CTAs per SM, loop size,
and where the loop's loads sit (LDG position and distance to first use).
`bracket MODES...`: the renorm bracket pass (`RenormConfig.bracket_copy` = MODE) at the default
shapes for 256 x 163840.
`bins VARIANTS...` (sweep variant names of kernels/gpu_sweep.py, e.g. default bins16 bins8):
the bracket pass and bracket_select of each RenormConfig variant at 256 x 163840 (kernels/NOTES.md,
"Sub-bracket bins (session 4)"), with the SASS of each loop (between a backward branch and its target).
`many [NAME=VALUE,...]...`: fingerprint_many's launches for the guard's full set at the default many
config with each override (e.g. ``many_long=rows``; default: "").
`topp_select [VARIANTS...]`: the top-p select kernel of each sweep variant (default: "default") at 256 x 163840
(scalar p): registers, stack, SASS counts, its loops (kernels/NOTES.md, "Top-p select rounds (session 4)";
`tps_split`: "Top-p select: padded rounds split (session 5)");
with TPS_DUMP=DIR the SASS and ttgir are written there. `bins` and `topp_select` with PDL=N: the kernels' PDL
constexpr (kernels/pdl.py; 3 = DEPENDENT_LATE; the bracket pass gets 1 for any N > 0).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OUT = tempfile.mkdtemp(prefix="tpguard-sass-")
ALU = ("SHF", "LOP3", "IADD3", "ISETP", "SEL", "PRMT", "LEA", "PLOP3")
FMA = ("IMAD", "VIADD")


def compile_kernel(fn, signature: dict, constexprs: dict, aligned: list[int], num_warps: int,
                   maxnreg: int | None, name: str):
    """(resource usage line, SASS text, ttgir text, dynamic shared memory bytes) of one
    specialisation (cuobjdump's SHARED is the static part only; Triton's buffers are dynamic)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature={**signature, **{c: "constexpr" for c in constexprs}},
                    constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
            **({"launch_pdl": True} if constexprs.get("PDL") else {})}
    cc = triton.compile(src, target=TARGET, options=opts)
    path = os.path.join(OUT, name + ".cubin")
    with open(path, "wb") as f:
        f.write(cc.asm["cubin"])
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True,
                         text=True).stdout.splitlines()[-1].strip()
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    return res, sass, cc.asm["ttgir"], cc.metadata.shared


def instructions(sass: str) -> list[tuple[int, str]]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    return out


def opcode(text: str) -> str:
    return text.split()[0].split(".")[0]


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """The body of the first predicated backward branch (the kernel's streaming loop)."""
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            return [t for a, t in ins if lo <= a <= addr]
    return []


def fingerprint(shifts: list[int]) -> None:
    from tpguard.kernels import fingerprint as k

    sig = {"words_ptr": "*i32", "rows_out_ptr": "*i64", "partial_ptr": "*i64", "top_ptr": "*i64",
           "n_rows": "i32", "n_words": "i32", "row_stride": "i32", "s_lo": "i64", "s_hi": "i64",
           "t_lo": "i64", "t_hi": "i64"}
    words_per_thread = 8 * 512 // (4 * 32)
    for mask in shifts:
        const = dict(MODE=0, EB=4, BR=8, BN=512, CHUNK_TILES=8, SHIFTS=mask)
        res, sass, _, _ = compile_kernel(k._rows_kernel, sig, const, [0, 1, 2, 3, 5, 6], 4, 128, f"rows_s{mask}")
        loop = collections.Counter(opcode(t) for t in main_loop(instructions(sass)))
        per = {op: n / words_per_thread for op, n in loop.items()}
        alu = sum(v for op, v in per.items() if op in ALU)
        fma = sum(v for op, v in per.items() if op in FMA)
        hi = sum(1 for t in main_loop(instructions(sass)) if t.startswith("IMAD.HI")) / words_per_thread
        print(f"fingerprint shifts={mask:2d}: {res}\n  loop per word: {sum(per.values()):.2f} instructions, "
              f"ALU pipe {alu:.2f}, FMA pipe {fma:.2f} (IMAD.HI {hi:.2f})")


REG = re.compile(r"\bR(\d+)\b")


def _dest_regs(text: str) -> set[int]:
    """Registers written by a load (LDG.128: 4 from its first operand)."""
    m = REG.search(text.split(None, 1)[1])
    width = 4 if ".128" in text else 2 if ".64" in text else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width)) if m else set()


def _first_use(loop: list[str], i: int, regs: set[int]) -> int:
    """Instructions from loop[i] to the first later one (wrapping to the next iteration) that
    reads one of `regs`; the loop length if none does."""
    n = len(loop)
    for d in range(1, n + 1):
        text = loop[(i + d) % n]
        parts = text.split(None, 1)
        if len(parts) < 2:
            continue
        operands = parts[1].split(",")
        srcs = ",".join(operands[1:]) if not opcode(text).startswith(("ST", "RED", "ATOM")) else parts[1]
        if regs & {int(r) for r in REG.findall(srcs)}:
            return d
    return n


def fingerprint_knobs(overrides: list[str]) -> None:
    """`_rows_kernel` for 256 x 163840 fp32 at the default KernelConfig with each `name=value,...`
    override: registers, stack, dynamic shared memory, CTAs per SM, loop instructions per word, and
    where the loop's loads sit: LDG positions in the loop and the distance in instructions to their
    first use (next iteration's hashing)."""
    from tpguard.config import replace_from_text
    from tpguard.kernels import fingerprint as k

    sig = {"words_ptr": "*i32", "rows_out_ptr": "*i64", "partial_ptr": "*i64", "top_ptr": "*i64",
           "n_rows": "i32", "n_words": "i32", "row_stride": "i32", "s_lo": "i64", "s_hi": "i64",
           "t_lo": "i64", "t_hi": "i64"}
    for text in overrides:
        cfg = replace_from_text(k.DEFAULT_CONFIG, text, "offline_sass knobs")
        br, bn, chunk_tiles, _ = k._tile(256, 163840, cfg)
        warps = k._warps(br * bn, cfg)
        const = dict(MODE=0, EB=4, BR=br, BN=bn, CHUNK_TILES=chunk_tiles, SHIFTS=cfg.shifts)
        res, sass, _, shared = compile_kernel(k._rows_kernel, sig, const, [0, 1, 2, 3, 5, 6], warps,
                                              cfg.maxnreg, "knobs")
        regs = int(re.search(r"REG:(\d+)", res).group(1))
        stack = int(re.search(r"STACK:(\d+)", res).group(1))
        by_regs = 65536 // (((regs + 7) // 8 * 8) * 32 * warps)
        by_smem = (228 * 1024) // (shared + 1024) if shared else 32
        ctas = min(by_regs, by_smem, 32, 64 // warps)
        loop = main_loop(instructions(sass))
        wpt = br * bn // (warps * 32)
        print(f"knobs {text or '(default)'}: tile [{br}, {bn}] x {warps} warps, {wpt} words/thread, "
              f"maxnreg {cfg.maxnreg}\n  REG {regs} STACK {stack} dynamic shared {shared} B -> "
              f"{ctas} CTAs/SM ({ctas * warps} warps); loop {len(loop)} SASS = {len(loop) / wpt:.2f} per word")
        ldg = [(i, t) for i, t in enumerate(loop) if opcode(t) == "LDG"]
        if ldg:
            dist = [_first_use(loop, i, _dest_regs(t)) for i, t in ldg]
            print(f"  LDG in loop {len(ldg)} ({sorted({t.split()[0] for _, t in ldg})}) at "
                  f"{', '.join(f'{100 * i // len(loop)}%' for i, _ in ldg)} of the loop; issue -> first use "
                  f"{min(dist)}-{max(dist)} instructions (mean {sum(dist) / len(dist):.0f})")


def bracket(modes: list[int]) -> None:
    from tpguard.kernels import renorm_passes as rp

    cfg = rp.RenormConfig()
    s = rp.shapes_for(256, 163840, cfg)
    sig = {"probs_ptr": "*fp32", "vocab": "i32", "n_chunks": "i32", "plan_ptr": "*i32", "mhi_ptr": "*fp64",
           "cnt_ptr": "*i32", "slots_ptr": "*fp32"}
    warps = cfg.bracket_pass_warps or cfg.pass_warps
    for mode in modes:
        const = dict(CHUNK=s.b_chunk, G=cfg.group, CAP=s.cap, PREFETCH=False, COPY_MODE=mode, BINS=0, BIN_SUB=128,
                     bmass_ptr=None)
        res, sass, ttgir, _ = compile_kernel(rp._bracket_kernel, sig, const, [0, 1, 3, 4, 5, 6], warps,
                                          rp.reg_cap(cfg.bracket_pass_maxnreg or cfg.bracket_maxnreg, warps).get("maxnreg"),
                                          f"bracket_{mode}")
        ops = collections.Counter(opcode(t) for _, t in instructions(sass))
        print(f"bracket pass, bracket_copy={mode}, {warps} warps: {res}\n  {sum(ops.values())} SASS, "
              f"BAR {ops['BAR']}, SHFL {ops['SHFL']}, convert_layout {ttgir.count('ttg.convert_layout')}")


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, opcode counts) of every backward-branch loop body, innermost first."""
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            out.append((lo, addr, collections.Counter(opcode(t) for a, t in ins if lo <= a <= addr)))
    return sorted(out, key=lambda x: x[1] - x[0])


def report(title: str, res, sass: str, adds: str) -> None:
    """Resources, SASS size, barrier / shuffle / `adds` counts and every loop body of a kernel."""
    ins = instructions(sass)
    ops = collections.Counter(opcode(t) for _, t in ins)
    print(f"{title}: {res}\n  {len(ins)} SASS, BAR {ops['BAR']}, SHFL {ops['SHFL']}, {adds} {ops[adds]}")
    for lo, hi, c in loops(ins):
        print(f"  loop {lo:#x}-{hi:#x}: {sum(c.values())} SASS ({', '.join(f'{k} {v}' for k, v in c.most_common(6))})")


def bins(variants: list[str]) -> None:
    from tpguard.kernels import renorm_passes as rp
    from tpguard.kernels.gpu_sweep import VARIANTS

    for name in variants:
        cfg = rp.RenormConfig().replace(**VARIANTS[name])
        s = rp.shapes_for(256, 163840, cfg)
        on = bool(cfg.bracket_bins)
        sig = {"probs_ptr": "*fp32", "vocab": "i32", "n_chunks": "i32", "plan_ptr": "*i32", "mhi_ptr": "*fp64",
               "cnt_ptr": "*i32", "slots_ptr": "*fp32", **({"bmass_ptr": "*fp64"} if on else {})}
        warps = cfg.bracket_pass_warps or cfg.pass_warps
        const = dict(CHUNK=s.b_chunk, G=cfg.group, CAP=s.cap, PREFETCH=bool(cfg.bracket_prefetch),
                     COPY_MODE=cfg.bracket_copy, BINS=cfg.bracket_bins, BIN_SUB=int(os.environ.get('BIN_SUB', 128)), **({} if on else {"bmass_ptr": None}),
                     PDL=int(os.environ.get("PDL", 0)) and 1)
        aligned = [0, 1, 3, 4, 5, 6] + ([7] if on else [])
        res, sass, _, _ = compile_kernel(rp._bracket_kernel, sig, const, aligned, warps,
                                      rp.reg_cap(cfg.bracket_pass_maxnreg or cfg.bracket_maxnreg, warps).get("maxnreg"),
                                      f"bpass_{name}")
        report(f"{name}: bracket pass ({warps} warps)", res, sass, "DADD")
        sig = {"probs_ptr": "*fp32", "vocab": "i32", "n_chunks": "i32", "n_groups": "i32", "plan_ptr": "*i32",
               "target_ptr": "*fp64", "params_ptr": "*fp32", "mhi_ptr": "*fp64", "cnt_ptr": "*i32", "slots_ptr": "*fp32",
               "cand_ptr": "*fp32", "list_cap": "i32", "gmax_ptr": "*fp32", "gid_ptr": "*i32",
               **({"bmass_ptr": "*fp64"} if on else {})}
        const = dict(CH_BLOCK=s.bch_block, NG_BLOCK=s.ng_block, CAP=s.cap, SUB=cfg.sub, REG=cfg.bracket_reg,
                     G=cfg.group, COPY=max(1, min(8, 8192 // s.cap)), EXACT_SPAN=rp.exact_span(cfg), BINS=cfg.bracket_bins,
                     BIN_W=rp.bins_window(cfg), BIN_STEP=int(os.environ.get('BIN_STEP', 4096)), **({} if on else {"bmass_ptr": None}),
                     PDL=int(os.environ.get("PDL", 0)))
        aligned = [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13] + ([14] if on else [])  # (n_chunks = 40)
        res, sass, _, _ = compile_kernel(rp._bracket_select_kernel, sig, const, aligned, cfg.bracket_warps,
                                      rp.reg_cap(cfg.bracket_maxnreg, cfg.bracket_warps).get("maxnreg"), f"bsel_{name}")
        report(f"{name}: bracket_select ({cfg.bracket_warps} warps)", res, sass, "DADD")


def topp_select(variants: list[str]) -> None:
    from tpguard.kernels import renorm_passes as rp
    from tpguard.kernels import renorm_top_p as tp
    from tpguard.kernels.gpu_sweep import VARIANTS

    for name in variants:
        cfg = rp.RenormConfig().replace(**VARIANTS[name])
        s = rp.shapes_for(256, 163840, cfg)
        sig = {"probs_ptr": "*fp32", "vocab": "i32", "n_chunks": "i32", "n_groups": "i32", "n_samples": "i32",
               "chunk_sum_ptr": "*fp64", "chunk_bad_ptr": "*i32", "gmax_ptr": "*fp32", "gsamp_ptr": "*fp32",
               "gid_ptr": "*i32", "cand_ptr": "*fp32", "list_cap": "i32", "p_ptr": "*fp32", "p_val": "fp32",
               "params_ptr": "*fp32", "flag_ptr": "*i32", "plan_ptr": "*i32", "target_ptr": "*fp64", "Z": "fp32"}
        ns_main, ns_rem = tp.sample_blocks(s.n_samples, s.ns_block, cfg.tps_split, 32 * cfg.select_warps)
        ng_rem = tp.sample_blocks(s.n_groups, s.ng_block, cfg.tps_split, 32 * cfg.select_warps)[1]
        const = dict(HAS_P_ARR=False, G=cfg.group, SG=cfg.sample_stride, CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block,
                     NS_BLOCK=ns_main, SUB=cfg.sub, REG=cfg.reg, TAU_GROUPS=cfg.tau_groups,
                     CSUB=cfg.compact_sub, MASS_FIRST=bool(cfg.tau_mass_first), TPS_SHARED=bool(cfg.tps_shared),
                     NS_REM=ns_rem, NG_REM=ng_rem, HI_SAMPLES=cfg.bracket_hi_samples, PDL=int(os.environ.get("PDL", 0)))
        aligned = [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16, 17]  # (n_chunks = 40)
        res, sass, ttgir, _ = compile_kernel(tp._top_p_select_kernel, sig, const, aligned, cfg.select_warps,
                                             rp.reg_cap(cfg.select_maxnreg, cfg.select_warps).get("maxnreg"),
                                             f"topp_select_{name}")
        if os.environ.get("TPS_DUMP"):
            with open(os.path.join(os.environ["TPS_DUMP"], f"topp_select_{name}.sass"), "w") as f:
                f.write(sass)
            with open(os.path.join(os.environ["TPS_DUMP"], f"topp_select_{name}.ttgir"), "w") as f:
                f.write(ttgir)
        report(f"{name}: top-p select ({cfg.select_warps} warps)", res, sass, "FADD")


def many_full(overrides: list[str]) -> None:
    """fingerprint_many's launches for the guard's full set (2 x 256 x 163840 fp32 + the decisions set)
    at the default many config with each override (e.g. ``many_long=rows``): each launch's
    registers, stack, CTAs per SM and its main loop's size."""
    from tpguard.bench.guard import make_tensors
    from tpguard.config import replace_from_text
    from tpguard.kernels import fingerprint as k

    tensors = list(make_tensors(64, 4, 163840, __import__("torch").device("cpu")).values())  # 256 rows
    k._check_tensor = lambda t, who: t  # CPU tensors: the plan is built for its launch shapes only
    for text in overrides:
        cfg = replace_from_text(k.KernelConfig(), text, "offline_sass many")
        plan = k.ManyPlan(tensors, cfg)
        print(f"many {text or '(default)'}: {plan.launches} launches")
        for launch in plan._kernel_launches:
            fn = launch.kernel
            names = list(launch.kernel.signature.parameters)
            meta = dict(launch.meta)
            warps = meta.pop("num_warps")
            maxnreg = meta.pop("maxnreg", None)
            sig, const, aligned = {}, dict(meta), []
            for i, (name, value) in enumerate(zip(names, launch.args)):
                if i == launch.out_pos:  # `out`, substituted per run (None in the recorded arguments)
                    sig[name] = "*i64"
                    aligned.append(i)
                elif value is None:
                    const[name] = None
                elif hasattr(value, "dtype"):
                    sig[name] = {"torch.int64": "*i64", "torch.int32": "*i32"}[str(value.dtype)]
                    aligned.append(i)
                else:
                    sig[name] = "i32"
            sig = {n: sig[n] for n in names if n in sig}
            res, sass, _, shared = compile_kernel(fn, sig, const, aligned, warps, maxnreg, "many")
            regs = int(re.search(r"REG:(\d+)", res).group(1))
            stack = int(re.search(r"STACK:(\d+)", res).group(1))
            ctas = min(65536 // (((regs + 7) // 8 * 8) * 32 * warps), 32, 64 // warps)
            ins = instructions(sass)
            sizes = [sum(c.values()) for _, _, c in loops(ins)]
            ldg = [c["LDG"] for _, _, c in loops(ins)]
            print(f"  {fn.fn.__name__} grid {launch.grid} x {warps} warps (maxnreg {maxnreg}): REG {regs} STACK {stack} "
                  f"-> {ctas} CTAs/SM; {len(ins)} SASS; loops (SASS, LDG): "
                  f"{', '.join(f'{n}/{m}' for n, m in zip(sizes, ldg))}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    values = [int(v) for v in sys.argv[2:]] if what in ("fingerprint", "bracket") else []
    if what == "fingerprint":
        fingerprint(values or [0])
    elif what == "knobs":
        fingerprint_knobs(sys.argv[2:] or [""])
    elif what == "bracket":
        bracket(values or [0])
    elif what == "topp_select":
        topp_select(sys.argv[2:] or ["default"])
    elif what == "bins":
        bins(sys.argv[2:] or ["default", "bins16"])
    elif what == "many":
        many_full(sys.argv[2:] or [""])
    else:
        sys.exit("usage: python kernels/offline_sass.py fingerprint SHIFTS... | knobs [NAME=VALUE,...]... "
                 "| bracket MODES... | bins VARIANTS... | topp_select [VARIANTS...] | many [NAME=VALUE,...]...")
