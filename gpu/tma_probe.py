"""Probe (GPU): do Hopper TMA loads (bulk tensor copies into shared memory, pipelined by Triton's
`tl.range(..., num_stages=S)`) make the fingerprint's lane kernel faster? (kernels/NOTES-fingerprint.md,
section 8: "The Hopper way is a TMA pipeline ... not tried".) 256 x 163840 fp32 (168 MB), one line per variant:

1. plain reads with ordinary loads (gpu/read_ceiling.py's best shapes): the same-process ceiling;
2. plain reads (int32 sum) through TMA: host descriptors (a CUtensorMap kernel parameter) and one
   device-built descriptor (`tl.make_tensor_descriptor`, global scratch from `triton.set_allocator`);
3. the fingerprint lane kernel fed by TMA (the hash helpers of tpguard.kernels.fingerprint, same
   partials [chunks, rows, 2]) + the existing `_finalize_kernel`, each variant checked bit for bit
   against the numpy definition, next to today's `fingerprint_triton` (lane launch alone, whole call).
4. (session 12, `--pair` or after 1-3) the guard's full set, logits + probs (2 x 168 MB): today's
   `fingerprint_many`, two one-tensor TMA calls, and ONE lane launch over both tensors (grid (row blocks,
   chunks of a + chunks of b)): host descriptors with one pipelined loop per tensor in branches, or one
   device-built descriptor from the selected tensor's address (one loop); + a finalize per tensor.
Kernel times: CUDA-graph replays of 10 launches each (as gpu/launch_gap_probe.py timed the lane launch: 44.1 us).

Usage:  PYTHONPATH=$PWD python3 gpu/tma_probe.py [--iters 50]                 (GPU, < 2 min)
        PYTHONPATH=/tmp/tri36:$PWD python gpu/tma_probe.py --offline          (no GPU: sm_90a compile of each
                                                                               TMA variant: regs, smem, TMA ops)
        PYTHONPATH=$PWD python gpu/tma_probe.py --interpret                   (CPU interpreter: bits, small tensors)
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

if "--interpret" in sys.argv:  # Triton picks the interpreter when @triton.jit runs: before the imports
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tpguard.kernels import fingerprint as fpk
# the TMA lane kernel itself is the product's since session 12 (kernels/fingerprint_tma.py; run 38 measured this
# probe's copy of it)
from tpguard.kernels.fingerprint_tma import _tma_chunk_lanes
from tpguard.kernels.fingerprint_tma import _tma_lanes_kernel as _tma_lanes

ref = importlib.import_module("tpguard.fingerprint")  # the module, not the re-exported function


@triton.jit
def _tma_sum(src, out_ptr, n_rows, n_cols, BR: tl.constexpr, BN: tl.constexpr, CHUNK_TILES: tl.constexpr,
             STAGES: tl.constexpr, DEVICE_DESC: tl.constexpr):
    """Plain read: int32 sum of a [BR, CHUNK_TILES * BN] chunk (TMA zero-fills out of bounds)."""
    if DEVICE_DESC:  # built per program in global scratch (triton.set_allocator)
        desc = tl.make_tensor_descriptor(src, [n_rows, n_cols], [n_cols, 1], [BR, BN])
    else:  # host-built CUtensorMap: a kernel parameter, nothing to build on the device
        desc = src
    rb = tl.program_id(0)
    c = tl.program_id(1)
    col0 = c * (CHUNK_TILES * BN)
    steps = tl.cdiv(tl.minimum(n_cols - col0, CHUNK_TILES * BN), BN)
    acc = tl.zeros([BR, BN], dtype=tl.int32)
    for k in tl.range(0, steps, num_stages=STAGES):
        acc += desc.load([rb * BR, col0 + k * BN])
    tl.store(out_ptr + rb * tl.num_programs(1) + c, tl.sum(tl.sum(acc, 1), 0))


@triton.jit(do_not_specialize=["s_lo_a", "s_lo_b"])
def _tma_pair_lanes(desc_a, desc_b, part_a, part_b, rows_a, words_a, rows_b, words_b, chunks_a, s_lo_a, s_lo_b,
                    BR: tl.constexpr, BN: tl.constexpr, CHUNK_TILES: tl.constexpr, STAGES: tl.constexpr):
    """One launch over two tensors, host descriptors: programs c < chunks_a hash a's chunk c, the others b's
    chunk c - chunks_a (each branch its own pipelined loop and shared-memory ring). Row blocks past a
    tensor's rows store nothing."""
    rb = tl.program_id(0)
    c = tl.program_id(1)
    if c < chunks_a:
        _tma_chunk_lanes(desc_a, part_a, rb, c, rows_a, words_a, s_lo_a, BR, BN, CHUNK_TILES, STAGES, 0)
    else:
        _tma_chunk_lanes(desc_b, part_b, rb, c - chunks_a, rows_b, words_b, s_lo_b, BR, BN, CHUNK_TILES, STAGES, 0)


@triton.jit(do_not_specialize=["s_lo_a", "s_lo_b"])
def _tma_pair_lanes_dev(a_ptr, b_ptr, part_a, part_b, rows_a, words_a, stride_a, rows_b, words_b, stride_b,
                        chunks_a, s_lo_a, s_lo_b, BR: tl.constexpr, BN: tl.constexpr, CHUNK_TILES: tl.constexpr,
                        STAGES: tl.constexpr):
    """The same with one device-built descriptor per program, from the selected tensor's address: one loop
    and one ring in the code (global scratch for the descriptor: triton.set_allocator)."""
    rb = tl.program_id(0)
    c = tl.program_id(1)
    in_a = c < chunks_a
    base = tl.where(in_a, a_ptr, b_ptr)
    rows = tl.where(in_a, rows_a, rows_b)
    words = tl.where(in_a, words_a, words_b)
    stride = tl.where(in_a, stride_a, stride_b)
    part = tl.where(in_a, part_a, part_b)
    s_lo = tl.where(in_a, s_lo_a, s_lo_b)
    cc = tl.where(in_a, c, c - chunks_a)
    desc = tl.make_tensor_descriptor(base, [rows, words], [stride, 1], [BR, BN])
    _tma_chunk_lanes(desc, part, rb, cc, rows, words, s_lo, BR, BN, CHUNK_TILES, STAGES, 0)


# (name, BR, BN, chunk words, stages, warps[, device descriptor]); 640 programs at 256 x 163840 unless noted
READ_VARIANTS = [("tma read [8,256] S3 w4", 8, 256, 8192, 3, 4, False),
                 ("tma read [8,256] S4 w4", 8, 256, 8192, 4, 4, False),
                 ("tma read [8,256] S2 w8", 8, 256, 8192, 2, 8, False),
                 ("tma read [8,256] S3 w8", 8, 256, 8192, 3, 8, False),
                 ("tma read [8,512] S3 w8", 8, 512, 8192, 3, 8, False),
                 ("tma read [8,256] S3 w4 device desc", 8, 256, 8192, 3, 4, True)]
FP_VARIANTS = [("tma fp [8,256] S2 w8", 8, 256, 8192, 2, 8),
               ("tma fp [8,256] S3 w8", 8, 256, 8192, 3, 8),
               ("tma fp [8,256] S4 w8", 8, 256, 8192, 4, 8),
               ("tma fp [8,256] S3 w4", 8, 256, 8192, 3, 4),
               ("tma fp [8,512] S3 w8", 8, 512, 8192, 3, 8),
               ("tma fp [8,256] S3 w8 chunk 16384 (320 progs)", 8, 256, 16384, 3, 8)]


def tma_read(x, br, bn, chunk, stages, warps, device_desc):
    w = x.view(torch.int32)
    rows, cols = w.shape
    grid = (triton.cdiv(rows, br), triton.cdiv(cols, chunk))
    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    src = w if device_desc else TensorDescriptor(w, [rows, cols], [cols, 1], [br, bn])
    return lambda: _tma_sum[grid](src, out, rows, cols, BR=br, BN=bn, CHUNK_TILES=chunk // bn, STAGES=stages,
                                  DEVICE_DESC=device_desc, num_warps=warps)


def tma_fingerprint(x, br, bn, chunk, stages, warps):
    """(lane launch, whole call) closures; the call returns (0-d top int64, rows int64 [rows])."""
    w = fpk._words(x)
    assert w.eb == 4 and w.rows <= fpk.SINGLE_TENSOR_CONFIG.finalize_rows, "probe: 4-byte words, fused top"
    s_lo, s_hi = fpk._seed_args(ref.row_seed(x.dtype, tuple(x.shape)))
    t_lo, t_hi = fpk._seed_args(ref.top_seed(x.dtype, tuple(x.shape)))
    chunks = triton.cdiv(w.n_words, chunk)
    partial = torch.empty((chunks, w.rows, 2), dtype=torch.int64, device=x.device)
    desc = TensorDescriptor(w.data, [w.rows, w.n_words], [w.row_stride, 1], [br, bn])
    fbr = fpk._next_pow2(w.rows)
    fbc = fpk._finalize_chunks(fbr, chunks)

    def lane():
        _tma_lanes[(triton.cdiv(w.rows, br), chunks)](desc, partial, w.rows, w.n_words, s_lo, BR=br, BN=bn,
                                                      CHUNK_TILES=chunk // bn, STAGES=stages, SHIFTS=0,
                                                      num_warps=warps)

    def call():
        lane()
        rows_out = torch.empty(w.rows, dtype=torch.int64, device=x.device)
        top = torch.empty(1, dtype=torch.int64, device=x.device)
        fpk._finalize_kernel[(1,)](partial, rows_out, top, w.rows, chunks, s_lo, s_hi, t_lo, t_hi, TOP=True,
                                   BR=fbr, BC=fbc, num_warps=fpk._warps(fbr * fbc, fpk.SINGLE_TENSOR_CONFIG))
        return top.view(()), rows_out
    return lane, call


def current_lane(x):
    """Today's lane launch alone, as `_hash_words` makes it for SINGLE_TENSOR_CONFIG."""
    cfg = fpk.SINGLE_TENSOR_CONFIG
    w = fpk._words(x)
    br, bn, chunk_tiles, chunks = fpk._tile(w.rows, w.n_words, cfg)
    s_lo, s_hi = fpk._seed_args(ref.row_seed(x.dtype, tuple(x.shape)))
    t_lo, t_hi = fpk._seed_args(ref.top_seed(x.dtype, tuple(x.shape)))
    partial = torch.empty((chunks, w.rows, 2), dtype=torch.int64, device=x.device)
    rows_out = torch.empty(w.rows, dtype=torch.int64, device=x.device)
    meta = dict(EB=w.eb, BR=br, BN=bn, CHUNK_TILES=chunk_tiles, SHIFTS=cfg.shifts,
                num_warps=fpk._warps(br * bn, cfg), **fpk._reg_opts(cfg))
    return lambda: fpk._rows_kernel[(triton.cdiv(w.rows, br), chunks)](
        w.data, rows_out, partial, rows_out, w.rows, w.n_words, w.row_stride, s_lo, s_hi, t_lo, t_hi, MODE=0, **meta)


def pair_fingerprints(a, b, device_desc, stages=3, warps=4, br=8, bn=256, chunk=8192):
    """(lane launch, whole call) closures over two same-shape 4-byte tensors; the call returns the two
    tensors' (top, rows) as `tma_fingerprint`'s does."""
    wa, wb = fpk._words(a), fpk._words(b)
    assert wa.eb == wb.eb == 4 and wa.rows == wb.rows and wa.n_words == wb.n_words
    sa, sb = (fpk._seed_args(ref.row_seed(t.dtype, tuple(t.shape))) for t in (a, b))
    ta, tb = (fpk._seed_args(ref.top_seed(t.dtype, tuple(t.shape))) for t in (a, b))
    chunks = triton.cdiv(wa.n_words, chunk)
    part = torch.empty((2 * chunks, wa.rows, 2), dtype=torch.int64, device=a.device)  # a's chunks, then b's
    pa, pb = part[:chunks], part[chunks:]
    grid = (triton.cdiv(wa.rows, br), 2 * chunks)
    meta = dict(BR=br, BN=bn, CHUNK_TILES=chunk // bn, STAGES=stages, num_warps=warps)
    if device_desc:
        def lane():
            _tma_pair_lanes_dev[grid](wa.data, wb.data, pa, pb, wa.rows, wa.n_words, wa.row_stride, wb.rows,
                                      wb.n_words, wb.row_stride, chunks, sa[0], sb[0], **meta)
    else:
        da, db = (TensorDescriptor(w.data, [w.rows, w.n_words], [w.row_stride, 1], [br, bn]) for w in (wa, wb))

        def lane():
            _tma_pair_lanes[grid](da, db, pa, pb, wa.rows, wa.n_words, wb.rows, wb.n_words, chunks, sa[0], sb[0],
                                  **meta)
    fbr = fpk._next_pow2(wa.rows)
    fbc = fpk._finalize_chunks(fbr, chunks)

    def call():
        lane()
        out = []
        for p, (s_lo, s_hi), (t_lo, t_hi) in ((pa, sa, ta), (pb, sb, tb)):
            rows_out = torch.empty(wa.rows, dtype=torch.int64, device=a.device)
            top = torch.empty(1, dtype=torch.int64, device=a.device)
            fpk._finalize_kernel[(1,)](p, rows_out, top, wa.rows, chunks, s_lo, s_hi, t_lo, t_hi, TOP=True,
                                       BR=fbr, BC=fbc, num_warps=fpk._warps(fbr * fbc, fpk.SINGLE_TENSOR_CONFIG))
            out.append((top.view(()), rows_out))
        return out
    return lane, call


def pair_bits_ok(call, refs) -> bool:
    return all(ref.to_unsigned(int(top.item())) == top_ref and torch.equal(rows.cpu(), rows_ref)
               for (top, rows), (top_ref, rows_ref) in zip(call(), refs))


def run_pair(iters: int) -> None:
    """Section 4: the guard's two big tensors, today's ways and one launch over both."""
    from tpguard.bench.timing import time_graph

    g = torch.Generator("cuda").manual_seed(1)
    a = torch.randn(256, 163840, generator=g, device="cuda")
    b = torch.softmax(torch.randn(256, 163840, generator=g, device="cuda"), -1)
    nbytes = 2 * a.numel() * 4
    refs = [reference(t) for t in (a, b)]

    def line(name, fn, extra=""):
        try:
            t = time_graph(fn, iters, per_replay=10)
            print(f"{name:60s} {t:7.1f} us {nbytes / t / 1e6:6.2f} TB/s {extra}", flush=True)
        except Exception as e:  # noqa: BLE001 - one line per failure, the run goes on
            torch.cuda.synchronize()
            print(f"{name:60s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)

    many_ok = torch.equal(fpk.fingerprint_many_triton([a, b]).cpu(),
                          torch.tensor([ref.to_signed(t) for t, _ in refs], dtype=torch.int64))
    line("pair: fingerprint_many([logits, probs]) (the guard's way)", lambda: fpk.fingerprint_many_triton([a, b]),
         f"bits {'ok' if many_ok else 'MISMATCH'}")
    one_ok = all(ref.to_unsigned(int(fpk.fingerprint_triton(t).item())) == r for t, (r, _) in zip((a, b), refs))
    line("pair: two fingerprint_triton calls (TMA lanes, 4 launches)",
         lambda: (fpk.fingerprint_triton(a), fpk.fingerprint_triton(b)), f"bits {'ok' if one_ok else 'MISMATCH'}")
    for name, dev, stages, warps in (("host descs, branches", False, 3, 4), ("host descs, branches", False, 2, 4),
                                     ("device desc, one loop", True, 3, 4), ("device desc, one loop", True, 3, 8)):
        label = f"pair: one launch, {name}, S{stages} w{warps}"
        try:
            lane, call = pair_fingerprints(a, b, dev, stages, warps)
            ok = pair_bits_ok(call, refs)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            print(f"{label:60s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)
            continue
        line(label + " lane", lane, f"bits {'ok' if ok else 'MISMATCH'}")
        line(label + " call", call, f"bits {'ok' if ok else 'MISMATCH'}")


def reference(x):
    rows = ref.fingerprint_rows_reference(x)
    return ref.combine_rows_reference(rows, x.dtype, tuple(x.shape)), rows


def bits_ok(call, top_ref, rows_ref) -> bool:
    top, rows = call()
    return ref.to_unsigned(int(top.item())) == top_ref and torch.equal(rows.cpu(), rows_ref)


def run_gpu(iters: int) -> None:
    from gpu.read_ceiling import _chunk_sum, _stride_sum
    from tpguard.bench.timing import time_graph

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    x = torch.randn(256, 163840, generator=torch.Generator("cuda").manual_seed(0), device="cuda")
    nbytes = x.numel() * 4
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    def line(name, fn, per=10, extra=""):
        try:
            t = time_graph(fn, iters, per_replay=per)
            print(f"{name:52s} {t:7.1f} us {nbytes / t / 1e6:6.2f} TB/s {extra}", flush=True)
            return t
        except Exception as e:  # noqa: BLE001 - one line per failure, the run goes on
            torch.cuda.synchronize()
            print(f"{name:52s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)
            return None

    w = x.view(torch.int32).reshape(-1)
    n = w.numel()
    out = torch.empty(2560, dtype=torch.int32, device="cuda")
    line("ldg read chunk 16384 block 2048 w4 (2560 progs)",
         lambda: _chunk_sum[(triton.cdiv(n, 16384),)](w, out, n, CHUNK=16384, BLOCK=2048, num_warps=4))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    line("ldg read stride block 4096 w8 (8/SM)",
         lambda: _stride_sum[(sms * 8,)](w, out, n, triton.cdiv(n, 4096), BLOCK=4096, num_warps=8))
    line("torch.sum", lambda: x.sum(), per=1)
    for name, *v in READ_VARIANTS:
        try:
            fn = tma_read(x, *v)
        except Exception as e:  # noqa: BLE001
            print(f"{name:52s} FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)
            continue
        line(name, fn)

    top_ref, rows_ref = reference(x)  # the numpy definition (tpguard.fingerprint on the host), ~3 s
    try:  # today's GPU path, as tpguard.bench.fingerprint calls it
        cur = "ok" if ref.fingerprint(x) == top_ref and bits_ok(
            lambda: (fpk.fingerprint_triton(x), fpk.fingerprint_rows_triton(x)), top_ref, rows_ref) else "MISMATCH"
        line("current lane launch (_rows_kernel, SINGLE_TENSOR_CONFIG)", current_lane(x))
    except Exception as e:  # noqa: BLE001
        cur = f"check FAILED {type(e).__name__}: {str(e)[:100]}"
    line("current fingerprint_triton call (lane + finalize)", lambda: fpk.fingerprint_triton(x), extra=f"bits {cur}")
    for name, *v in FP_VARIANTS:
        try:
            lane, call = tma_fingerprint(x, *v)
            ok = bits_ok(call, top_ref, rows_ref)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            print(f"{name:52s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)
            continue
        status = f"bits {'ok' if ok else 'MISMATCH'}"
        line(name + " lane", lane, extra=status)
        line(name + " call", call, extra=status)
    run_pair(iters)


def offline() -> None:
    """Compile each TMA variant for sm_90a at the 256 x 163840 launch's specialisation (no GPU)."""
    from tpguard.kernels.offline_sass import compile_kernel, instructions, loops

    def show(name, fn, sig, const, aligned, warps):
        try:
            res, sass, ttgir, shared = compile_kernel(fn, sig, const, aligned, warps, None, "tma_probe")
        except Exception as e:  # noqa: BLE001
            print(f"{name}: COMPILE FAILED {type(e).__name__}: {str(e)[:300]}")
            return
        regs = int(re.search(r"REG:(\d+)", res).group(1))
        ctas = min(65536 // (((regs + 7) // 8 * 8) * 32 * warps), (228 * 1024) // (shared + 1024), 64 // warps, 32)
        bufs = sorted(set(re.findall(r"!ttg\.memdesc<(\d+x\d+x\d+)x", ttgir)))
        stack = re.search(r"STACK:(\d+)", res).group(1)
        ldg, lds = len(re.findall(r" LDG", sass)), len(re.findall(r" LDS", sass))
        # the steady-state loop: the smallest loop that issues a TMA load
        body = min((c for _, _, c in loops(instructions(sass)) if c["UTMALDG"]), key=lambda c: sum(c.values()),
                   default=None)
        wpt = const["BR"] * const["BN"] // (32 * warps)
        main = (f"main loop {sum(body.values())} SASS = {sum(body.values()) / wpt:.2f}/word ({wpt} words/thread), "
                f"BAR.SYNC {body['BAR']}, UTMALDG {body['UTMALDG']}, LDS {body['LDS']}") if body else "no TMA loop"
        print(f"{name}: REG {regs} STACK {stack}, dynamic smem {shared} B "
              f"-> {ctas} CTAs/SM; TTGIR async_tma_copy {ttgir.count('ttng.async_tma_copy_global_to_local')}, "
              f"wait_barrier {ttgir.count('ttng.wait_barrier')}, ring buffers {bufs or 'none'}; SASS UTMALDG "
              f"{sass.count('UTMALDG')}, SYNCS {sass.count('SYNCS')}, UTMACCTL/fence {sass.count('UTMACCTL')}, "
              f"LDG {ldg}, LDS {lds}\n  {main}")

    for name, br, bn, chunk, stages, warps, dev in READ_VARIANTS:
        src = "*i32" if dev else f"tensordesc<i32[{br},{bn}]>"
        show(name, _tma_sum, {"src": src, "out_ptr": "*i32", "n_rows": "i32", "n_cols": "i32"},
             dict(BR=br, BN=bn, CHUNK_TILES=chunk // bn, STAGES=stages, DEVICE_DESC=dev),
             [0, 1, 2, 3] if dev else [1, 2, 3], warps)
    for name, br, bn, chunk, stages, warps in FP_VARIANTS:
        show(name, _tma_lanes, {"desc": f"tensordesc<i32[{br},{bn}]>", "partial_ptr": "*i64", "n_rows": "i32",
                                "n_words": "i32", "s_lo": "i64"},
             dict(BR=br, BN=bn, CHUNK_TILES=chunk // bn, STAGES=stages, SHIFTS=0), [1, 2, 3], warps)


def offline_pair() -> None:
    """The two-tensor launches compiled for sm_90a (registers, shared memory: two rings or one)."""
    from tpguard.kernels.offline_sass import compile_kernel

    ints = {"rows_a": "i32", "words_a": "i32", "rows_b": "i32", "words_b": "i32", "chunks_a": "i32",
            "s_lo_a": "i64", "s_lo_b": "i64"}
    const = dict(BR=8, BN=256, CHUNK_TILES=32, STAGES=3)
    for name, fn, sig, aligned in (
            ("pair host descs", _tma_pair_lanes, {"desc_a": "tensordesc<i32[8,256]>", "desc_b": "tensordesc<i32[8,256]>",
                                                  "part_a": "*i64", "part_b": "*i64", **ints}, [2, 3]),
            ("pair device desc", _tma_pair_lanes_dev, {"a_ptr": "*i32", "b_ptr": "*i32", "part_a": "*i64",
                                                       "part_b": "*i64", "rows_a": "i32", "words_a": "i32",
                                                       "stride_a": "i32", "rows_b": "i32", "words_b": "i32",
                                                       "stride_b": "i32", "chunks_a": "i32", "s_lo_a": "i64",
                                                       "s_lo_b": "i64"}, [0, 1, 2, 3])):
        try:
            res, sass, ttgir, shared = compile_kernel(fn, sig, const, aligned, 4, None, "tma_pair")
            print(f"{name}: {res} dynamic smem {shared} B, UTMALDG {sass.count('UTMALDG')}")
        except Exception as e:  # noqa: BLE001
            print(f"{name}: COMPILE FAILED {type(e).__name__}: {str(e)[:300]}")


def interpret() -> None:
    """CPU interpreter: the TMA lane kernel + finalize against the numpy definition (tails, partial row blocks)."""
    for shape, v in (((4, 3000), (8, 256, 1024, 3, 4)), ((9, 2048), (8, 256, 512, 2, 8)),
                     ((16, 700), (16, 256, 512, 3, 8)), ((3, 260), (8, 256, 8192, 4, 8))):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        top_ref, rows_ref = reference(x)
        _, call = tma_fingerprint(x, *v)
        print(f"interpreter {shape} tile [{v[0]},{v[1]}] chunk {v[2]} S{v[3]}: "
              f"bits {'ok' if bits_ok(call, top_ref, rows_ref) else 'MISMATCH'}", flush=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(9, 3000, generator=g), torch.randn(9, 3000, generator=g)
    for dev in (False, True):
        _, call = pair_fingerprints(a, b, dev, chunk=1024)
        ok = pair_bits_ok(call, [reference(a), reference(b)])
        print(f"interpreter pair (9, 3000) x 2, {'device desc' if dev else 'host descs'}: "
              f"bits {'ok' if ok else 'MISMATCH'}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--pair", action="store_true", help="only section 4 (the two-tensor launches)")
    a = ap.parse_args()
    if a.offline:
        offline()
        offline_pair()
    elif a.interpret:
        interpret()
    elif a.pair:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        run_pair(a.iters)
    else:
        run_gpu(a.iters)
