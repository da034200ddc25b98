#!/usr/bin/env bash
# All GPU checks of tpguard in as few device calls as possible (docs/benchmarks.md records the
# results). Runs on `nvidia-h200-x2` (2 GPUs; the one-GPU checks use one of them) or
# `nvidia-h200` (PHASES without the nccl_* ones).
#
#   device run, carry [".whl", ".gpu"]:   PHASES=call1 bash gpu/run_all.sh     (or call2, or a list)
#
# Calls (each fits one 600 s device call; docs/benchmarks.md names the run of each number):
#   call1-call3  session 1: kernels, fingerprints, guard, harness on 1 GPU; guard/harness/sglang over NCCL
#   call4        the flashinfer harness runs (2,000 steps) and every sglang site over NCCL
#   call5        renorm variant sweep, fingerprint sweep, guard cost (+ fused write pass), EAGLE greedy + sampler
#   call6        validation: every GPU kernel test, the table, 1,000-call audit, fingerprint tests, guard over NCCL
#   call7        fingerprint/graph GPU tests and the guard's cost after the direct-launch fix
#   call8        the guard on 1 GPU (incl. renorm + guard with the fused slot in one graph), then
#                the guard bench and gpu/graph_nccl_check.py over NCCL (capture + replay, planted divergence)
#   call9        (next; session 3's plan, supersedes call8) GPU 0: the guard on 1 GPU (in-graph costs,
#                the fused slot), the fingerprint sweep (shift masks); GPU 1: the renorm variant sweep
#                (bsel_radix, bracket_copy) and the kernel tests; then call8's NCCL part
#   call10       session 4: the guard (zero-copy, heal kernels), fingerprint knobs, renorm host profile and
#                bins sweep, every GPU kernel test, NCCL guard + graph check, cross-GPU renorm bytes
#   call11       session 4's final validation: sweep, table, 1,000-call audit, all GPU tests, NCCL, cross-GPU
#   call12       session 4's last: the table alone, then every GPU kernel test next to the fingerprint/graph tests
#   call13       session 5: fingerprint tpguard.fp/2: compiled tests, bench, guard on 1 GPU and over NCCL
#   call14       session 5: the fp/2 fingerprint sweep (tiles and waves), the compiled fingerprint tests
#   call15       session 5: compiled fingerprint tests; renorm call plans (tests, host time); fingerprint sweep
#   call16       session 5's validation: every GPU kernel test, the bracket_regions sweep (removed since), fingerprint tests, the table
#   call17       session 5's last: guard/plan GPU tests, the 1,000-call audit through the plans, the guard over NCCL
#   call18       session 6: read ceiling, fingerprint fill_ctas_per_sm, top-p stream split probe, tps_split, guard
#   call19       session 6: hi_samples / bracket-pass cap sweep, stream split for every op, fingerprint grid, guard, tests
#   call20       session 6: sweep around the new defaults, row split probe + GPU test, kernels table, fingerprint tests
#   call21       session 6's validation: sweep, row split, table, GPU smoke tests, host time, audit, fingerprint
#   call22       session 6's last: full-set tile, guard (1 GPU), every GPU kernel test next to the fingerprint tests
#   call23       session 7: the GPU tests left from session 6 and the new PDL / eager split ones, launch-gap probe
#   call24       session 8 (planned in session 7): GPU tests, pdl 0 / 1 / 2, the fingerprint's launches apart, tile sweep
#   call25       session 8 (planned): the side-by-side table with flashinfer, the 1,000-call audit
#   call26       session 8 (planned): every GPU kernel test next to the fingerprint/graph/heal tests
#   call27       session 8: run 26's failing tau-search test verbosely, then call25 (table, audit, host profile)
#   call28       session 8's last: the fixed tau test, the PDL tests run 26 did not reach, call24's fingerprint
#                sweep, the guard on 1 GPU, the launch-gap probe (pdl 0 / 1 / 2)
#   call30       (next) every GPU kernel test in one call: three pytest processes side by side (run 26's one
#                process was cut at 420 s with 168 tests run: the compiles are CPU-bound, the machine has 16 cores),
#                then the fingerprint with KernelConfig.last_finalize timed against the default (run 30; that
#                option lost and was removed in session 10: the phase now times the default alone)
#   call31       (next, after call30) session 9's host-time work: per eager call with launch templates as Triton
#                hands them, trimmed (kernels/direct_launch.py), and replayed from the plan's own graph
#                (kernels/renorm_graph.py); the plan GPU tests, the host profile, the batch-size cells beside
#                flashinfer (plan graphs at <= 64 rows)
#   call33       session 10: call31, then the guard bench on 1 GPU (run 31)
#   call34       session 10's last: the batch-size cells with the plan-graph rule and without graphs, the guard
#                bench, every GPU kernel test next to the fingerprint / graph / heal tests (pytest-xdist)
#   call35       session 11: the one-launch top-k at 1-8 rows: GPU tests, in-process A/B (gpu/fused_ab.py), the
#                batch-size cells, every GPU kernel test
#   call36       session 11: host time of an eager top-k call by layer, the one-launch kernel's knobs, its GPU tests
#   call37       session 11's last: the one-launch top-k's final rule beside flashinfer, the batch-size cells, every GPU kernel test
#   call38       session 12: the TMA fingerprint probe; the one-launch top-k at 8-64 rows; every renorm GPU test
#   call39       session 12: the TMA lane launch in the product: one tensor, the guard's full set, fingerprint GPU tests
#   call40       session 12: one lane launch over the guard's two big tensors; the final code's fingerprint tests
#   call41       session 12's last: the audit at 8 and 256 rows on today's code; the audit's GPU tests
#   nccl_guard   the guard bench over NCCL and gpu/graph_nccl_check.py (TPGUARD_FP_CONFIG applies there too)
#
# .whl/: slim flashinfer-python 0.7.2.post1 + apache-tvm-ffi + the pure-python/cp312 wheels that
#        sglang 0.5.23's hooked modules import (docs/benchmarks.md says how they were fetched)
# .gpu/: flashinfer-jit/sampling.so (flashinfer's sampling module built on an H200: no 100 s JIT),
#        sglang_py.zip (sglang 0.5.23's Python modules, without its Rust .so files)
# Everything a phase writes goes under /tmp/res/<phase>/; it all comes back as $OUT/results.tgz,
# with $OUT/summary.txt (the short lines each phase printed).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/res
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TRITON_INTERPRET=0 OMP_NUM_THREADS=4
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
SUMMARY=/tmp/res/summary.txt
say() { echo "[$(el)s] $*" | tee -a "$SUMMARY"; cp "$SUMMARY" "$OUT/summary.txt"; }
# If the call is about to be cut at its time limit, still bring back what is there.
# (killed at the end: a live sleeper would hold the call open until TAR_AT)
TAR_PID=; [ -n "${TAR_AT:-}" ] && { ( sleep "$TAR_AT"; tar czf "$OUT/results.tgz" -C /tmp res 2>/dev/null ) > /dev/null 2>&1 & TAR_PID=$!; }

# --- set-up -------------------------------------------------------------------------------------
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /tmp/res/pip.log 2>&1 || say "wheel install failed: $(tail -2 /tmp/res/pip.log)"
# sglang's JIT verify kernel checks that flashinfer's cutlass include path exists (the slim wheel
# drops cutlass; the speculative-sampling kernel does not include it).
mkdir -p /tmp/site/flashinfer/data/cutlass/include /tmp/site/flashinfer/data/cutlass/tools/util/include
if [ -f .gpu/flashinfer-jit/sampling.so ]; then
  mkdir -p /tmp/site/flashinfer/data/aot/sampling && cp .gpu/flashinfer-jit/sampling.so /tmp/site/flashinfer/data/aot/sampling/
fi
[ -f .gpu/sglang_py.zip ] && python3 -c "import zipfile; zipfile.ZipFile('.gpu/sglang_py.zip').extractall('/tmp/sg')"
# The repo first: tpguard/__init__.py maps tpguard.kernels/.hooks/.launch to the top-level folders.
export PYTHONPATH=$PWD:/tmp/sg:/tmp/site
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)', torch.cuda.get_device_name(0))";
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; python3 -c "import sglang; print('sglang', sglang.__version__)"; } > /tmp/res/env.txt 2>&1
say "env: $(tr '\n' ';' < /tmp/res/env.txt)"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
G2=$(( NGPU > 1 ? 1 : 0 ))  # the second GPU when there is one

# --- phases ---------------------------------------------------------------------------------------
kernels() {  # issue 3: renorm kernels on the GPU: tests, variant sweep, the table, audit
  local d=/tmp/res/kernels; mkdir -p $d
  if [ -z "${K_NO_PYTEST:-}" ]; then  # (rc read right after pytest: a test in between would reset $?)
    timeout ${K_PYTEST:-100} python3 -m pytest -q -p no:cacheprovider --maxfail=5 tests/test_renorm_kernels.py tests/test_renorm_reference.py tests/test_renorm_write_fp.py ${K_PYTEST_EXTRA:-} > $d/pytest.log 2>&1
    local rc=$?; say "kernels pytest rc=$rc $(tail -1 $d/pytest.log)"
  fi
  [ -n "${K_ONLY_PYTEST:-}" ] && return
  [ -z "${K_NO_SWEEP:-}" ] && { timeout ${K_SWEEP:-80} python3 kernels/gpu_sweep.py --budget ${K_SWEEP_BUDGET:-50} ${K_SWEEP_ARGS:-} --json $d/sweep.json > $d/sweep.log 2>&1
    say "kernels sweep rc=$?"; }
  local best; best=$(python3 - $d/sweep.json <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
    r, variants = data["variants"], data["configs"]
    keys = ("top_p_flat", "top_k40_flat", "top_k_top_p_flat", "top_p_peaky")
    ok = {v: sum(c[k]["us"] for k in keys) for v, c in r.items()
          if all(k in c and "us" in c[k] and c[k]["same_kept_as_reference"] for k in keys)}
    best = min(ok, key=ok.get)
    print(",".join(f"{k}={v}" for k, v in variants[best].items()))
except Exception:
    print("")
PY
)
  say "kernels best variant: '${best}'"
  [ -n "${K_NO_BENCH:-}" ] && return
  TPGUARD_RENORM_CONFIG="$best" timeout ${K_BENCH:-150} python3 -m tpguard.bench.kernels --graphs --impls tpguard,flashinfer,flashinfer-det,torch --json $d/bench.json > $d/bench.log 2>&1
  say "kernels bench rc=$?"
  [ -n "${K_NO_AUDIT:-}" ] && return
  TPGUARD_RENORM_CONFIG="$best" timeout ${K_AUDIT:-60} python3 -m tpguard.audit --calls ${AUDIT_CALLS:-200} --device cuda --rows 256 --vocab 163840 > $d/audit.log 2>&1
  say "kernels audit rc=$?"
}

fingerprint() {  # fingerprint kernels: CUDA tests and throughput
  local d=/tmp/res/fingerprint; mkdir -p $d
  [ -z "${FP_NO_PYTEST:-}" ] && { timeout ${FP_PYTEST:-60} python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_guard_graphs.py tests/test_heal_copy.py tests/test_fingerprint.py > $d/pytest.log 2>&1
    say "fingerprint+graph pytest rc=$? $(tail -1 $d/pytest.log)"; }
  [ -n "${FP_NO_BENCH:-}" ] && return
  timeout ${FP_BENCH_TIMEOUT:-80} python3 -m tpguard.bench.fingerprint ${FP_BENCH_ARGS:-} > $d/bench.log 2>&1
  say "fingerprint bench rc=$? $(grep -E '^main:|best' $d/bench.log | head -3 | tr '\n' ' ')"
}

guard1() {  # issue 6 on one GPU: the guard's cost (graph replay and eager), the fused write pass
  local d=/tmp/res/guard1; mkdir -p $d
  timeout ${G_TIMEOUT:-70} python3 -m tpguard.bench.guard --profile ${GUARD_ARGS:-} --json $d/guard1.json > $d/bench.log 2>&1
  say "guard bench (1 GPU) rc=$? $(grep -E 'device work|target_probs from|one graph|inside a graph|host time|direct-launch|full mode, ' $d/bench.log)"
  timeout 60 python3 -m tpguard.bench.guard --fused-probs --json $d/fused_probs.json > $d/fused_probs.log 2>&1
  say "fused write pass rc=$? $(grep -E 'checks|write' $d/fused_probs.log | tr '\n' ' ')"
}

harness1() {  # issue 4: 2 ranks sharing one GPU over gloo
  local d=/tmp/res/harness1; mkdir -p $d
  OUT=$d BUDGET_S=${HARNESS_BUDGET:-170} timeout 260 bash launch/gpu_check.sh > $d/gpu_check.log 2>&1
  say "harness (2 ranks, 1 GPU, gloo) rc=$?"; grep "gpu_check:" $d/gpu_check.log | cut -c1-260 | tee -a "$SUMMARY"
}

sglang1() {  # issue 5: sglang's DFlash verify with the plugin, 2 ranks sharing one GPU
  local d=/tmp/res/sglang1; mkdir -p $d
  timeout ${SGLANG_TIMEOUT:-300} python3 -m tpguard.hooks.gpu_check_sglang $d/sglang1.json --configs default,deterministic --timeout $(( ${SGLANG_TIMEOUT:-300} / 2 )) > $d/log.txt 2>&1
  say "sglang (1 GPU, gloo) rc=$?"; grep -E "PASS|FAIL|^  " $d/log.txt | cut -c1-260 | tee -a "$SUMMARY"
}

nccl_guard() {  # issue 7.3/7.4: guard cost and fused heal over NCCL; graph capture with the all-gather
  local d=/tmp/res/nccl_guard; mkdir -p $d
  timeout ${G2_TIMEOUT:-150} torchrun --nproc-per-node 2 -m tpguard.bench.guard --json $d/guard2.json > $d/bench.log 2>&1
  say "guard bench (2 GPUs, NCCL) rc=$?"; grep -E "device work|one graph|inside a graph|eager|heal:" $d/bench.log | tee -a "$SUMMARY"
  TRACE_DIR=$d/trace timeout 90 torchrun --nproc-per-node 2 gpu/graph_nccl_check.py $d/graph.json > $d/graph.log 2>&1
  say "graph capture (NCCL) rc=$? $(tail -1 $d/graph.log)"
}

nccl_guard_bench() {  # the guard's cost over NCCL only
  local d=/tmp/res/nccl_guard; mkdir -p $d
  timeout ${G2_TIMEOUT:-80} torchrun --nproc-per-node 2 -m tpguard.bench.guard ${GUARD_ARGS:-} --json $d/guard2.json > $d/bench.log 2>&1
  say "guard bench (2 GPUs, NCCL) rc=$?"; grep -E "device work|target_probs from|one graph|inside a graph|host time|direct-launch|eager|heal:" $d/bench.log | tee -a "$SUMMARY"
}

nccl_harness() {  # issue 7.1: the harness over NCCL, 256 x 163840, top_p 0.9, flat, DFlash chain
  local d=/tmp/res/nccl_harness; mkdir -p $d
  local steps=${NCCL_STEPS:-2000}
  local common="--device cuda --backend nccl --bs 32 --draft-tokens 8 --vocab 163840 --logits flat --top-p 0.9 --algo dflash --no-progress --timeout 120"
  local runs=${RUNS:-"flashinfer:flashinfer:record flashinfer-det:flashinfer-det:record torch:torch:record tpguard:tpguard:record flashinfer-heal:flashinfer:heal"}
  for run in $runs; do
    IFS=: read -r name renorm policy <<< "$run"
    local n=$steps; [[ $renorm == flashinfer ]] && n=${FI_STEPS:-$steps}
    timeout ${RUN_TIMEOUT:-200} python3 -m tpguard.cli launch --nproc-per-node 2 $common --renorm $renorm --on-divergence $policy \
      --steps $n --trace $d/$name.trace --summary-json $d/$name.json > $d/$name.log 2>&1
    local rc=$?
    say "nccl harness $name rc=$rc $(python3 -c "
import json,sys
d=json.load(open('$d/$name.json')); f=d.get('first_divergence') or {}
print(f\"steps {d.get('steps_done')}/{d.get('steps_planned')} divergences {d.get('divergences')} first {f.get('step')} {f.get('quantity')} culprit {f.get('culprit_ranks')} flips {d.get('decision_flips')} healed {d.get('actions',{}).get('healed',0)} identical {d.get('outputs_identical')} {d.get('ms_per_step')} ms/step guard {d.get('guard_ms_per_step')} ms\")" 2>&1 | tail -1)"
  done
  rm -rf $d/*.trace/dumps
}

nccl_sglang() {  # issue 7.2: sglang's verify functions with the plugin over NCCL (SITE: dflash, eagle, ...)
  local site=${1:-dflash} configs=${2:-}; local d=/tmp/res/nccl_sglang; mkdir -p $d
  timeout ${SGLANG_TIMEOUT:-300} python3 -m tpguard.hooks.gpu_check_sglang $d/$site.json --nccl --site $site \
    ${configs:+--configs $configs} --timeout 240 > $d/$site.log 2>&1
  say "sglang $site (2 GPUs, NCCL) rc=$?"; grep -E "PASS|FAIL|^  " $d/$site.log | cut -c1-300 | tee -a "$SUMMARY"
}

cross_gpu() {  # issue 3: the same input on both GPUs gives the same bytes from every renorm
  local d=/tmp/res/cross_gpu; mkdir -p $d
  timeout ${X_TIMEOUT:-120} python3 gpu/cross_gpu_check.py $d/cross_gpu.json > $d/log.txt 2>&1
  say "cross-GPU renorm check rc=$? $(tail -1 $d/log.txt)"
}

hostprof() {  # where an eager small-batch renorm call spends its host time
  local d=/tmp/res/hostprof; mkdir -p $d
  timeout ${HP_TIMEOUT:-90} python3 -m tpguard.bench.kernels --host-profile > $d/log.txt 2>&1
  say "renorm host profile rc=$? $(grep '^host time' $d/log.txt | sed 's/host time per eager call, //' | tr '\n' ' ')"
}

table_audit() {  # the side-by-side table with flashinfer, the 1,000-call audit, the eager host profile
  local d=/tmp/res/kernels; mkdir -p $d
  timeout 300 python3 -m tpguard.bench.kernels --graphs --impls tpguard,flashinfer,flashinfer-det,torch --json $d/bench.json > $d/bench.log 2>&1
  say "kernels bench rc=$? $(grep '^targets' $d/bench.log)"
  # flashinfer's JIT-built sampling module back as $OUT/sampling.so (.gpu/flashinfer-jit/: no JIT next time)
  local so; so=$(find "$HOME/.cache/flashinfer" -name 'sampling*.so' -size -30M 2>/dev/null | head -1)
  [ -n "$so" ] && [ ! -f .gpu/flashinfer-jit/sampling.so ] && cp "$so" "$OUT/sampling.so"
  timeout 150 python3 -m tpguard.audit --calls 1000 --device cuda --rows 256 --vocab 163840 > $d/audit.log 2>&1
  say "kernels audit rc=$?"
  HP_TIMEOUT=80 hostprof  # where an eager 1-row call's host time goes (the small-batch eager cells)
}

plans() {  # the renorm call plans (cached workspace + direct launches): their GPU tests, host time per eager call
  local d=/tmp/res/plans; mkdir -p $d
  timeout ${PL_PYTEST:-150} python3 -m pytest -q -p no:cacheprovider tests/test_renorm_plan.py > $d/pytest.log 2>&1
  say "renorm plan pytest rc=$? $(tail -1 $d/pytest.log)"
  timeout ${PL_BENCH:-150} python3 -m tpguard.bench.renorm_host --gpu --batch-sizes ${PL_BATCHES:-1,8,64,256} > $d/host.log 2>&1
  say "renorm host time rc=$? $(grep -iE 'bits|refus' $d/host.log | head -3 | tr '\n' ' ')"
}

fi_jit() {  # flashinfer's sampling module JIT-built (~100 s), back as $OUT/sampling.so (.gpu/flashinfer-jit/ next time)
  [ -f .gpu/flashinfer-jit/sampling.so ] && return
  local d=/tmp/res/fi_jit; mkdir -p $d
  timeout 300 python3 -c "import torch, flashinfer.sampling as s; p = torch.softmax(torch.randn(4, 4096, device='cuda'), -1); s.top_p_renorm_probs(p, 0.9); s.top_k_renorm_probs(p, 40); torch.cuda.synchronize(); print('built')" > $d/log.txt 2>&1
  say "flashinfer sampling JIT rc=$? $(tail -1 $d/log.txt | cut -c1-200)"
  local so; so=$(find "$HOME/.cache/flashinfer" -name 'sampling*.so' -size -30M 2>/dev/null | head -1)
  [ -n "$so" ] && cp "$so" "$OUT/sampling.so"
}

guard_bench() {  # the guard bench on 1 GPU within $1 s (no profile, no fused-write bench: guard1 has both)
  local d=/tmp/res/guard1; mkdir -p $d
  timeout $1 python3 -m tpguard.bench.guard --json $d/guard1.json > $d/bench.log 2>&1
  say "guard bench (1 GPU) rc=$? $(grep -E 'device work|one graph|inside a graph|full mode, ' $d/bench.log | tr '\n' ';')"
}

call31() {  # session 9's host-time work measured (PHASES=call31 below says what)
  PL_BATCHES=1,8,64 PL_BENCH=150 plans
  HP_TIMEOUT=80 hostprof
  local d=/tmp/res/kernels31; mkdir -p $d
  TPGUARD_RENORM_GRAPH_ROWS=64 timeout 200 python3 -m tpguard.bench.kernels --graphs --impls tpguard,flashinfer \
    --vocabs 163840 --logits flat --json $d/bench.json > $d/bench.log 2>&1
  say "kernels bench (batch sizes) rc=$?"; tail -30 $d/bench.log | cut -c1-200 | tee -a "$SUMMARY"
}

fused_cells() {  # $1: results folder; gpu/fused_ab.py, then the batch-size cells beside flashinfer (session 11)
  local d=$1; mkdir -p $d
  timeout ${AB_TIMEOUT:-120} python3 gpu/fused_ab.py > $d/ab.log 2>&1; say "fused_ab rc=$?"; cut -c1-160 $d/ab.log | tee -a "$SUMMARY"
  timeout ${BENCH_TIMEOUT:-120} python3 -m tpguard.bench.kernels --graphs --impls tpguard,flashinfer --vocabs 163840 \
    --logits flat --top-ks 40 --repeats 50 --json $d/bench.json > $d/bench.log 2>&1
  say "kernels bench rc=$?"; grep -A27 "^### batch sizes" $d/bench.log | grep -E "tpguard|flashinfer" | cut -c1-120 | tee -a "$SUMMARY"
  grep -hE "^targets|^direct launches" $d/bench.log | cut -c1-300 | tee -a "$SUMMARY"
}

gpu_tests() {  # $1: results folder, $2: until when (s since the start), then test files: every GPU test (xdist -n 8)
  local d=$1 until=$2; shift 2; mkdir -p $d
  local x8=; python3 -c "import xdist" 2>/dev/null && x8="-n 8"
  TPGUARD_RENORM_GPU_TESTS=all timeout $(( until - $(el) )) python3 -m pytest -q -rfE -p no:cacheprovider $x8 "$@" \
    > $d/kernels.log 2>&1
  say "GPU tests: $(tail -1 $d/kernels.log)"; grep -hE "^(FAILED|ERROR)" $d/kernels.log | cut -c1-200 | tee -a "$SUMMARY"
}

on_gpu() { local g=$1; shift; ( export CUDA_VISIBLE_DEVICES=$g; "$@" ); }

PHASES=${PHASES:-call1}
case "$PHASES" in
  call1)
    ( on_gpu 0 kernels ) & P1=$!
    ( on_gpu $G2 fingerprint; on_gpu $G2 guard1; on_gpu $G2 harness1 ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && nccl_guard
    ;;
  call2)
    ( on_gpu 0 sglang1 ) & P1=$!
    ( on_gpu $G2 guard1 ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && { nccl_guard; FI_STEPS=${FI_STEPS:-500} nccl_harness; nccl_sglang dflash default,deterministic,audit; }
    ;;
  call3)
    ( export K_PYTEST=90 K_SWEEP=70 K_BENCH=130 K_AUDIT=45; on_gpu 0 kernels ) & P1=$!
    ( export FP_BENCH_ARGS=--sweep SGLANG_TIMEOUT=150; on_gpu $G2 fingerprint; on_gpu $G2 guard1; on_gpu $G2 sglang1 ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && nccl_guard_bench
    ;;
  call4)  # issue 7: the long flashinfer runs and every sglang site over NCCL, three chains at once
    ( RUNS="flashinfer:flashinfer:record flashinfer-heal:flashinfer:heal" nccl_harness ) & P1=$!
    ( nccl_sglang dflash default,deterministic,audit; nccl_sglang eagle ) & P2=$!
    ( nccl_sglang eagle-greedy; nccl_sglang sampler ) & P3=$!
    wait $P1 $P2 $P3  # not a bare wait: the TAR_AT sleeper is a background job too
    ;;
  call5)  # measure the new kernel variants and the guard; the EAGLE-greedy and sampler sites
    ( export K_NO_PYTEST=1 K_NO_AUDIT=1 K_NO_BENCH=1 K_SWEEP=300 K_SWEEP_BUDGET=240; on_gpu 0 kernels ) & P1=$!
    ( export FP_NO_PYTEST=1 FP_BENCH_ARGS=--sweep FP_BENCH_TIMEOUT=150 G_TIMEOUT=120; on_gpu $G2 fingerprint; on_gpu $G2 guard1 ) & P2=$!
    ( nccl_sglang eagle-greedy; nccl_sglang sampler ) & P3=$!
    wait $P1 $P2 $P3
    G2_TIMEOUT=120 nccl_guard_bench
    ;;
  call6)  # validate the final code: every GPU kernel test, 1,000-call audit, the table, the guard over NCCL
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=300 K_ONLY_PYTEST=1; on_gpu 0 kernels ) & P1=$!
    ( export K_NO_PYTEST=1 K_NO_SWEEP=1 K_BENCH=150 AUDIT_CALLS=1000 K_AUDIT=120 FP_PYTEST=150 FP_NO_BENCH=1
      on_gpu $G2 kernels; on_gpu $G2 fingerprint ) & P2=$!
    wait $P1 $P2
    G2_TIMEOUT=120 nccl_guard_bench
    ;;
  call7)  # the direct-launch fix and the compiled fingerprint tests; the guard's cost after it
    ( export FP_PYTEST=200 FP_NO_BENCH=1; on_gpu 0 fingerprint ) & P1=$!
    ( export G_TIMEOUT=100; on_gpu $G2 guard1 ) & P2=$!
    wait $P1 $P2
    G2_TIMEOUT=100 nccl_guard_bench
    ;;
  call8)
    ( export G_TIMEOUT=150; on_gpu 0 guard1 ) & P1=$!
    wait $P1
    [ "$NGPU" -gt 1 ] && nccl_guard
    ;;
  call9)
    # ~580 s on nvidia-h200-x2 (run with TAR_AT=575): max(290, 320) s, then ~220 s over NCCL
    ( export G_TIMEOUT=110 FP_NO_PYTEST=1 FP_BENCH_ARGS=--sweep FP_BENCH_TIMEOUT=120; on_gpu 0 guard1; on_gpu 0 fingerprint ) & P1=$!
    ( export FP_PYTEST=70 FP_NO_BENCH=1 K_PYTEST=80 K_NO_AUDIT=1 K_NO_BENCH=1 K_SWEEP=170 K_SWEEP_BUDGET=140
      # (run 9's variants were removed after it; git show 6168847:kernels/gpu_sweep.py has them)
      export K_SWEEP_ARGS="--breakdown default --variants default,bcopy_scan"
      on_gpu $G2 fingerprint; on_gpu $G2 kernels ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && G2_TIMEOUT=130 nccl_guard
    ;;
  call10)
    # session 4, ~450 s on nvidia-h200-x2 (TAR_AT=580): GPU 0 the guard (zero-copy default, heal kernels),
    # the fingerprint knob sweep, the renorm host profile, the fingerprint/graph GPU tests; GPU 1 the
    # renorm sweep (sub-bracket bins) and every GPU kernel test; then NCCL (guard + heal, graph check)
    # and the cross-GPU renorm check
    ( export G_TIMEOUT=120 FP_NO_PYTEST=1 FP_BENCH_ARGS=--sweep FP_BENCH_TIMEOUT=110
      on_gpu 0 guard1; on_gpu 0 fingerprint; on_gpu 0 hostprof
      FP_NO_PYTEST= FP_NO_BENCH=1 FP_PYTEST=200 on_gpu 0 fingerprint ) & P1=$!
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=300 K_NO_AUDIT=1 K_NO_BENCH=1 K_SWEEP=130 K_SWEEP_BUDGET=110
      export K_SWEEP_ARGS="${K10_SWEEP_ARGS:---breakdown default --variants default}"
      on_gpu $G2 kernels ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && { G2_TIMEOUT=130 nccl_guard; cross_gpu; }
    ;;
  call11)
    # session 4's final validation, ~460 s on nvidia-h200-x2 (TAR_AT=585): GPU 0 the renorm sweep (the
    # default vs tps_shared), the table and the 1,000-call audit with the sweep's best, the fingerprint/graph
    # GPU tests; GPU 1 every GPU kernel test and the fingerprint bench; then NCCL (guard, graph check) and
    # the cross-GPU check
    ( export K_NO_PYTEST=1 K_SWEEP=60 K_SWEEP_BUDGET=45 K_BENCH=150 AUDIT_CALLS=1000 K_AUDIT=160
      export K_SWEEP_ARGS="--breakdown default,tps_shared --variants default,tps_shared,bins0"
      on_gpu 0 kernels; FP_NO_BENCH=1 FP_PYTEST=200 on_gpu 0 fingerprint ) & P1=$!
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=300 K_ONLY_PYTEST=1
      on_gpu $G2 kernels; FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=60 on_gpu $G2 fingerprint ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && { G2_TIMEOUT=100 nccl_guard; cross_gpu; }
    ;;
  call12)
    # session 4's last call (~330 s, TAR_AT=470): the table with the final defaults on a quiet machine, then
    # every GPU kernel test (GPU 0) next to the fingerprint/graph GPU tests (GPU 1)
    ( export K_NO_PYTEST=1 K_NO_SWEEP=1 K_NO_AUDIT=1 K_BENCH=120; on_gpu 0 kernels )
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=330 K_ONLY_PYTEST=1; on_gpu 0 kernels ) & P1=$!
    ( export FP_NO_BENCH=1 FP_PYTEST=330; on_gpu $G2 fingerprint ) & P2=$!
    wait $P1 $P2
    ;;
  call13)
    # session 5, fingerprint tpguard.fp/2 (~560 s on nvidia-h200-x2, TAR_AT=585): GPU 0 the compiled
    # fingerprint/graph/heal tests, then the fingerprint bench; GPU 1 the guard on one GPU and the fused
    # write pass; then the guard over NCCL and the graph check
    ( export FP_PYTEST=200 FP_BENCH_TIMEOUT=90; on_gpu 0 fingerprint ) & P1=$!
    ( export G_TIMEOUT=90; on_gpu $G2 guard1 ) & P2=$!
    wait $P1 $P2
    [ "$NGPU" -gt 1 ] && G2_TIMEOUT=110 nccl_guard
    ;;
  call14)
    # session 5 (~330 s on nvidia-h200): the fingerprint sweep for fp/2 (tiles, waves), then the compiled
    # fingerprint tests (the GPU check with today's KernelConfig fields)
    ( export FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=200 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 120"
      fingerprint ); ( FP_NO_BENCH=1 FP_PYTEST=150 fingerprint )
    ;;
  call15)
    # session 5 (~330 s on nvidia-h200-x2, TAR_AT=560): GPU 0 the compiled fingerprint/graph/heal tests (fp/2,
    # fused_finalize, the shared direct-launch helpers); GPU 1 the renorm call plans (tests, host time), then
    # the fingerprint sweep (fused_finalize; removed since, a rerun sweeps the list of today)
    ( export FP_NO_BENCH=1 FP_PYTEST=300; on_gpu 0 fingerprint ) & P1=$!
    ( on_gpu $G2 plans; export FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=120 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 60"
      on_gpu $G2 fingerprint ) & P2=$!
    wait $P1 $P2
    ;;
  call16)
    # session 5's validation (~500 s on nvidia-h200-x2, TAR_AT=570): GPU 0 every GPU kernel test (with the call
    # plans' tests); GPU 1 the renorm sweep (run 17: default vs bracket_regions, removed since; now default vs tps_split, per-pass breakdown), the compiled
    # fingerprint/graph/heal tests (direct launches through kernels/direct_launch.py), then the kernels table
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=420 K_ONLY_PYTEST=1 K_PYTEST_EXTRA=tests/test_renorm_plan.py
      on_gpu 0 kernels ) & P1=$!
    ( export K_NO_PYTEST=1 K_SWEEP=140 K_SWEEP_BUDGET=110 K_NO_BENCH=1
      export K_SWEEP_ARGS="--variants default,tps_split --breakdown default,tps_split"; on_gpu $G2 kernels
      FP_NO_BENCH=1 FP_PYTEST=170 on_gpu $G2 fingerprint
      export K_NO_SWEEP=1 K_NO_BENCH= K_NO_AUDIT=1 K_BENCH=150; on_gpu $G2 kernels ) & P2=$!
    wait $P1 $P2
    ;;
  call17)
    # session 5's last (~330 s on nvidia-h200-x2, TAR_AT=390): GPU 0 the guard/plan GPU tests (direct launches
    # of the guard's comparison, plans under their lock), then the 1,000-call audit through the call plans;
    # GPU 1 the guard bench over NCCL afterwards (direct-launch state, fp/2 costs) and the graph check
    ( timeout 150 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_guard_graphs.py tests/test_renorm_plan.py \
        > /tmp/res/gpu_tests.log 2>&1; say "guard/plan GPU tests rc=$? $(tail -1 /tmp/res/gpu_tests.log)"
      export K_NO_PYTEST=1 K_NO_SWEEP=1 K_NO_BENCH= K_BENCH=0 AUDIT_CALLS=1000 K_AUDIT=170
      d=/tmp/res/kernels; mkdir -p $d
      timeout $K_AUDIT python3 -m tpguard.audit --calls 1000 --device cuda --rows 256 --vocab 163840 > $d/audit.log 2>&1
      say "kernels audit (plans) rc=$?" )
    [ "$NGPU" -gt 1 ] && G2_TIMEOUT=100 nccl_guard
    ;;
  call18)
    # (calls 18-20 name sweep variants as they were when they ran: tps_split (the default since; tps_split0 is
    # the code before it), bpass_r96/r80/r64 (bracket_pass_maxnreg; 80 the default), bsel_w8r16k
    # (bracket_warps=8, the default); gpu_sweep.py skips names it does not know)
    # session 6, first call (~480 s on nvidia-h200, TAR_AT=560): the read ceiling of one 168 MB tensor,
    # the fingerprint's fill_ctas_per_sm configs, the top-p row-split-on-streams probe, the renorm sweep
    # (default vs tps_split, per pass), the guard on one GPU
    ( mkdir -p /tmp/res/probe; timeout 100 python3 -P gpu/read_ceiling.py > /tmp/res/probe/read_ceiling.log 2>&1
      say "read ceiling rc=$? $(tail -1 /tmp/res/probe/read_ceiling.log)"
      export FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=130 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 100 --sweep-configs ${FP_CONFIGS:-block_words=2048,maxnreg=none|block_words=2048,maxnreg=none,fill_ctas_per_sm=8|block_words=2048,maxnreg=none,fill_ctas_per_sm=7|block_words=2048,maxnreg=none,fill_ctas_per_sm=16|block_words=4096,maxnreg=none,num_warps=8,fill_ctas_per_sm=4|block_words=1024,maxnreg=none,fill_ctas_per_sm=12|fill_ctas_per_sm=4}"
      fingerprint
      timeout 100 python3 -P gpu/stream_split_probe.py --json /tmp/res/probe/split.json > /tmp/res/probe/split.log 2>&1
      say "stream split probe rc=$? $(grep -E 'flat' /tmp/res/probe/split.log | tr -s ' ' | tr '\n' ';')"
      export K_NO_PYTEST=1 K_SWEEP=140 K_SWEEP_BUDGET=110 K_NO_BENCH=1
      export K_SWEEP_ARGS="--variants default,tps_split --breakdown default,tps_split"; kernels
      mkdir -p /tmp/res/guard1; timeout 80 python3 -m tpguard.bench.guard --json /tmp/res/guard1/guard1.json > /tmp/res/guard1/bench.log 2>&1
      say "guard bench (1 GPU) rc=$? $(grep -E 'device work|target_probs from|one graph|inside a graph' /tmp/res/guard1/bench.log | tr '\n' ';')" )
    ;;
  call19)
    # session 6, second call (~420 s on nvidia-h200, TAR_AT=570): the renorm sweep (bracket_hi_samples, the
    # bracket pass's own register cap) with per-pass times, the row-split-on-streams probe for every op, the
    # fingerprint tile grid (one tensor and the guard's full set), the guard on one GPU, then the GPU kernel
    # smoke tests and the compiled fingerprint tests with today's defaults
    ( mkdir -p /tmp/res/probe /tmp/res/guard1
      export K_NO_PYTEST=1 K_SWEEP=170 K_SWEEP_BUDGET=140 K_NO_BENCH=1
      export K_SWEEP_ARGS="--variants default,hi0,hi32,bpass_r96,bpass_r80,bpass_r64,bchunk8k_w8 --breakdown default,hi0"; kernels
      timeout 100 python3 -P gpu/stream_split_probe.py --json /tmp/res/probe/split.json > /tmp/res/probe/split.log 2>&1
      say "stream split probe rc=$? $(grep -E 'par2|base' /tmp/res/probe/split.log | tr -s ' ' | tr '\n' ';')"
      export FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=150 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 100 --sweep-configs ${FP_CONFIGS:-block_words=2048,maxnreg=none|block_words=2048,maxnreg=none,fill_ctas_per_sm=7|block_words=2048,maxnreg=none,fill_ctas_per_sm=14|block_words=2048,maxnreg=none,fill_ctas_per_sm=21|block_words=2048,maxnreg=none,chunk_words=2048|block_words=2048,maxnreg=none,chunk_words=4096|block_words=1024,maxnreg=none,chunk_words=2048|block_words=1024,maxnreg=none,chunk_words=4096|block_words=4096,maxnreg=none,chunk_words=2048|block_words=4096,maxnreg=none,chunk_words=4096|block_words=4096,maxnreg=none,num_warps=8,chunk_words=2048|block_words=4096,maxnreg=none,num_warps=8,chunk_words=4096|block_words=4096,maxnreg=none,num_warps=8,chunk_words=8192|block_words=2048,maxnreg=none,num_warps=8,chunk_words=4096|block_words=2048,maxnreg=none,num_warps=8,chunk_words=8192|block_words=8192,maxnreg=none,num_warps=8,chunk_words=4096|block_words=2048,maxnreg=none,rows_per_tile=4,chunk_words=4096|block_words=2048,maxnreg=none,rows_per_tile=4,chunk_words=8192|block_words=1024,maxnreg=none,rows_per_tile=4,chunk_words=4096|block_words=2048,maxnreg=none,rows_per_tile=2,chunk_words=8192|block_words=1024,maxnreg=none,rows_per_tile=1,chunk_words=16384|block_words=2048,maxnreg=none,rows_per_tile=1,chunk_words=16384|block_words=2048,maxnreg=none,rows_per_tile=1,chunk_words=16384,num_warps=8|block_words=4096,maxnreg=none,rows_per_tile=1,chunk_words=16384,num_warps=8|block_words=4096,maxnreg=none,rows_per_tile=1,chunk_words=32768,num_warps=8} --full-set-configs ${FP_FULL:-|block_words=2048,maxnreg=none|block_words=2048,maxnreg=none,chunk_words=4096|block_words=2048,maxnreg=none,chunk_words=2048|block_words=2048,maxnreg=none,fill_ctas_per_sm=7|block_words=2048,maxnreg=none,fill_ctas_per_sm=14|block_words=4096,maxnreg=none,num_warps=8,chunk_words=4096|block_words=4096,maxnreg=none,num_warps=8,chunk_words=2048|block_words=1024,maxnreg=none,chunk_words=4096|chunk_words=4096|chunk_words=2048|block_words=2048,maxnreg=none,rows_per_tile=1,chunk_words=16384,num_warps=8|block_words=2048,maxnreg=none,many_long=rows,chunk_words=4096}"
      fingerprint; grep -E "best" /tmp/res/fingerprint/bench.log | tee -a "$SUMMARY"
      timeout 80 python3 -m tpguard.bench.guard --json /tmp/res/guard1/guard1.json > /tmp/res/guard1/bench.log 2>&1
      say "guard bench (1 GPU) rc=$? $(grep -E 'device work|target_probs from|one graph|inside a graph' /tmp/res/guard1/bench.log | tr '\n' ';')"
      K_NO_PYTEST= K_ONLY_PYTEST=1 K_PYTEST=120 kernels
      FP_NO_PYTEST= FP_NO_BENCH=1 FP_PYTEST=100 fingerprint )
    ;;
  call20)
    # session 6, third call (~470 s on nvidia-h200, TAR_AT=575): the renorm sweep around the new defaults
    # (bracket-pass cap, bracket_select at 8 warps) with per-pass times, the row split (kernels/row_split.py)
    # against the unsplit call and external parts, its GPU test, the kernels table (tpguard, graph replay),
    # then the compiled fingerprint/graph/heal tests
    ( mkdir -p /tmp/res/probe
      export K_NO_PYTEST=1 K_SWEEP=120 K_SWEEP_BUDGET=100 K_NO_BENCH=1
      export K_SWEEP_ARGS="--variants default,bpass0,bpass_r72,bpass_r88,bsel_w8r16k --breakdown default"; kernels
      timeout 100 python3 -P gpu/stream_split_probe.py --json /tmp/res/probe/split.json > /tmp/res/probe/split.log 2>&1
      say "stream split probe rc=$? $(grep -E 'split|base' /tmp/res/probe/split.log | tr -s ' ' | tr '\n' ';')"
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_row_split.py > /tmp/res/probe/pytest.log 2>&1
      say "row split GPU test rc=$? $(tail -1 /tmp/res/probe/pytest.log)"
      mkdir -p /tmp/res/kernels; timeout 120 python3 -m tpguard.bench.kernels --graphs --impls tpguard --json /tmp/res/kernels/bench.json > /tmp/res/kernels/bench.log 2>&1
      say "kernels bench rc=$?"
      FP_NO_BENCH=1 FP_PYTEST=200 fingerprint )
    ;;
  call21)
    # session 6, validation (~450 s on nvidia-h200, TAR_AT=580): the sweep (default vs bracket_select at 16
    # warps) with per-pass times, the row split probe, the kernels table (tpguard, graph replay), the GPU smoke
    # tests (kernels, row split, plans' direct launches), the eager host time, the audit, the fingerprint
    ( mkdir -p /tmp/res/probe /tmp/res/kernels /tmp/res/plans
      export K_NO_PYTEST=1 K_SWEEP=90 K_SWEEP_BUDGET=70 K_NO_BENCH=1
      export K_SWEEP_ARGS="--variants default,bsel_w16 --breakdown default"; kernels
      timeout 100 python3 -P gpu/stream_split_probe.py --json /tmp/res/probe/split.json > /tmp/res/probe/split.log 2>&1
      say "stream split probe rc=$? $(grep -E 'split|base' /tmp/res/probe/split.log | tr -s ' ' | tr '\n' ';')"
      timeout 130 python3 -m tpguard.bench.kernels --graphs --impls tpguard --json /tmp/res/kernels/bench.json > /tmp/res/kernels/bench.log 2>&1
      say "kernels bench rc=$? $(grep '^targets' /tmp/res/kernels/bench.log)"
      K_NO_PYTEST= K_ONLY_PYTEST=1 K_PYTEST=150 K_PYTEST_EXTRA="tests/test_row_split.py tests/test_renorm_plan.py" kernels
      timeout 60 python3 -m tpguard.bench.renorm_host --gpu --batch-sizes 1,8,256 > /tmp/res/plans/host.log 2>&1
      say "renorm host time rc=$? $(grep -iE 'bits|refus' /tmp/res/plans/host.log | head -3 | tr '\n' ' ')"
      timeout 70 python3 -m tpguard.audit --calls 200 --device cuda --rows 256 --vocab 163840 > /tmp/res/kernels/audit.log 2>&1
      say "kernels audit rc=$?"
      FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=40 FP_BENCH_ARGS="--shapes main" fingerprint )
    ;;
  call22)
    # session 6's last (~480 s on nvidia-h200, TAR_AT=585): the fingerprint's full set with the new one-tensor tile,
    # the guard on one GPU (default, and with that tile), then every GPU kernel test next to the compiled
    # fingerprint/graph/heal tests
    ( export FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=60 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 20 --sweep-configs block_words=2048,num_warps=8,maxnreg=none --full-set-configs |block_words=2048,num_warps=8,maxnreg=none|block_words=2048,num_warps=8,maxnreg=128|block_words=4096,num_warps=8,maxnreg=128|block_words=2048,num_warps=8,maxnreg=none,chunk_words=16384"
      fingerprint; grep -E "^  KernelConfig|best" /tmp/res/fingerprint/bench.log | cut -c1-220 | tee -a "$SUMMARY"
      mkdir -p /tmp/res/guard1
      timeout 60 python3 -m tpguard.bench.guard --json /tmp/res/guard1/guard1.json > /tmp/res/guard1/bench.log 2>&1
      say "guard bench (1 GPU) rc=$? $(grep -E 'device work|inside a graph|zero-copy' /tmp/res/guard1/bench.log | tr '\n' ';')"
      timeout 60 python3 -m tpguard.bench.guard --config block_words=2048,num_warps=8,maxnreg=none > /tmp/res/guard1/bench_w8.log 2>&1
      say "guard bench (1 GPU, w8 tile) rc=$? $(grep -E 'device work|inside a graph|zero-copy' /tmp/res/guard1/bench_w8.log | tr '\n' ';')" )
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=380 K_ONLY_PYTEST=1 K_PYTEST_EXTRA="tests/test_renorm_plan.py tests/test_row_split.py"
      kernels ) & P1=$!
    ( FP_NO_BENCH=1 FP_PYTEST=330 fingerprint ) & P2=$!
    wait $P1 $P2
    ;;
  call23)
    # session 7, first call (~420 s on nvidia-h200, TAR_AT=570): the GPU tests left from session 6 (the split tau
    # search, the row split incl. its 100-row case) and the new ones (PDL, the eager split), then the launch-gap
    # probe (RenormConfig.pdl, an eager row split since dropped, the fingerprint finalize as a dependent launch: eager and
    # graph us, same bits)
    ( mkdir -p /tmp/res/probe
      timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_renorm_kernels.py -k tps_split \
        tests/test_row_split.py tests/test_pdl.py tests/test_renorm_plan.py > /tmp/res/probe/pytest.log 2>&1
      say "GPU tests (tps_split, row split, pdl, plans) rc=$? $(tail -1 /tmp/res/probe/pytest.log)"
      grep -E "^(FAILED|ERROR)" /tmp/res/probe/pytest.log | cut -c1-200 | tee -a "$SUMMARY"
      timeout 250 python3 -P gpu/launch_gap_probe.py --json /tmp/res/probe/gaps.json > /tmp/res/probe/gaps.log 2>&1
      say "launch gap probe rc=$?"; cut -c1-230 /tmp/res/probe/gaps.log | tee -a "$SUMMARY" )
    ;;
  call24)
    # session 8's first call (written in session 7, not run yet; ~480 s on nvidia-h200, TAR_AT=570): the GPU tests
    # left open (the split tau search needs TPGUARD_RENORM_GPU_TESTS=all; PDL, row split, plans), the launch-gap
    # probe (pdl 0 / 1 / 2 and today's default; the fingerprint's two launches apart), a fingerprint tile sweep
    # (FP_SWEEP / FP_FULL: '|'-separated KernelConfig overrides, docs/benchmarks.md "Session 7" lists the planned ones)
    ( mkdir -p /tmp/res/probe
      TPGUARD_RENORM_GPU_TESTS=all timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_renorm_kernels.py -k tps_split > /tmp/res/probe/pytest_tps.log 2>&1
      say "GPU tests (tps_split, all) rc=$? $(tail -1 /tmp/res/probe/pytest_tps.log)"
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_row_split.py tests/test_pdl.py tests/test_renorm_plan.py > /tmp/res/probe/pytest.log 2>&1
      say "GPU tests (row split, pdl, plans) rc=$? $(tail -1 /tmp/res/probe/pytest.log)"
      grep -hE "^(FAILED|ERROR)" /tmp/res/probe/pytest*.log | cut -c1-200 | tee -a "$SUMMARY"
      timeout 150 python3 -P gpu/launch_gap_probe.py --configs base,pdl,pdl2,default --json /tmp/res/probe/gaps.json > /tmp/res/probe/gaps.log 2>&1
      say "launch gap probe rc=$?"; cut -c1-230 /tmp/res/probe/gaps.log | tee -a "$SUMMARY"
      w8=block_words=2048,num_warps=8,maxnreg=none  # (SINGLE_TENSOR_CONFIG; one row per tile: contiguous programs)
      sweep="$w8|$w8,rows_per_tile=1,chunk_words=32768|$w8,rows_per_tile=2,chunk_words=16384|$w8,rows_per_tile=4"
      sweep+="|$w8,rows_per_tile=4,chunk_words=16384|block_words=4096,num_warps=8,maxnreg=none,rows_per_tile=1,chunk_words=32768"
      sweep+="|block_words=1024,num_warps=4,maxnreg=none,rows_per_tile=1,chunk_words=16384"
      sweep+="|block_words=1024,num_warps=4,maxnreg=none,rows_per_tile=1,chunk_words=32768"
      full="|$w8,rows_per_tile=1,chunk_words=32768|rows_per_tile=1,chunk_words=32768|rows_per_tile=2,chunk_words=16384"
      export FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=100 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 45 --sweep-configs ${FP_SWEEP:-$sweep} --full-set-configs ${FP_FULL:-$full}"
      fingerprint; grep -E "^  KernelConfig|best|^main" /tmp/res/fingerprint/bench.log | cut -c1-220 | tee -a "$SUMMARY" )
    ;;
  call25)
    # session 8's table (written in session 7; ~480 s on nvidia-h200, TAR_AT=575; carry .whl with the slim flashinfer
    # + apache-tvm-ffi + orjson): the side-by-side table with flashinfer (its sampling JIT first, ~100 s), the
    # 1,000-call audit, the host profile of eager 1-row calls
    table_audit
    ;;
  call26)
    # session 8's tests (written in session 7; ~480 s, TAR_AT=585): every GPU kernel test (incl. plans, row split,
    # PDL) next to the compiled fingerprint/graph/heal tests
    ( export TPGUARD_RENORM_GPU_TESTS=all K_PYTEST=420 K_ONLY_PYTEST=1 K_PYTEST_EXTRA="tests/test_renorm_plan.py tests/test_row_split.py tests/test_pdl.py"
      kernels ) & P1=$!
    ( FP_NO_BENCH=1 FP_PYTEST=330 fingerprint ) & P2=$!
    wait $P1 $P2
    ;;
  call27)
    # session 8 (~520 s on nvidia-h200, TAR_AT=580; carry .whl, .gpu): run 26 failed
    # test_tps_split_tau_search_exact[1]: run 27 ran a probe here (both searches vs the exact pattern at 1-8 warps,
    # 20 calls each; folded into that test since), then the test verbosely; then call25
    ( mkdir -p /tmp/res/tau_split
      TPGUARD_RENORM_GPU_TESTS=all timeout 60 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_renorm_kernels.py -k tau_search > /tmp/res/tau_split/pytest.log 2>&1
      say "tau search tests rc=$?"; grep -E "PASS|FAIL|XFAIL|XPASS|^E " /tmp/res/tau_split/pytest.log | head -12 | cut -c1-200 | tee -a "$SUMMARY" )
    table_audit
    ;;
  call28)
    # session 8's last (~470 s on nvidia-h200, TAR_AT=520; carry .whl, .gpu): the tau test fixed after run 27 and
    # the two PDL tests run 26's limit cut (offline compiles), side by side; then timings alone on the GPU
    ( mkdir -p /tmp/res/tests28
      TPGUARD_RENORM_GPU_TESTS=all timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_renorm_kernels.py -k tau_search > /tmp/res/tests28/tau.log 2>&1 &
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py -k "check_rules or wait_before_memory" > /tmp/res/tests28/pdl.log 2>&1 &
      wait; say "tau search tests: $(tail -1 /tmp/res/tests28/tau.log); pdl offline tests: $(tail -1 /tmp/res/tests28/pdl.log)"
      w8=block_words=2048,num_warps=8,maxnreg=none
      sweep="$w8|$w8,rows_per_tile=1,chunk_words=32768|$w8,rows_per_tile=2,chunk_words=16384|$w8,rows_per_tile=4"
      sweep+="|block_words=4096,num_warps=8,maxnreg=none,rows_per_tile=1,chunk_words=32768"
      sweep+="|block_words=1024,num_warps=4,maxnreg=none,rows_per_tile=1,chunk_words=32768"
      full="|$w8,rows_per_tile=1,chunk_words=32768|rows_per_tile=1,chunk_words=32768"
      FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=100 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 45 --sweep-configs $sweep --full-set-configs $full" fingerprint
      grep -E "^  KernelConfig|best|^main" /tmp/res/fingerprint/bench.log | cut -c1-220 | tee -a "$SUMMARY"
      G_TIMEOUT=80 guard1
      mkdir -p /tmp/res/probe; timeout 120 python3 -P gpu/launch_gap_probe.py --configs base,pdl,pdl2 --json /tmp/res/probe/gaps.json > /tmp/res/probe/gaps.log 2>&1
      say "launch gap probe rc=$?"; cut -c1-230 /tmp/res/probe/gaps.log | tee -a "$SUMMARY" )
    ;;
  call30)
    # the next session's GPU test call (~420 s, TAR_AT=570; carry .whl, .gpu): every GPU test of the kernels
    # (TPGUARD_RENORM_GPU_TESTS=all) in three processes, next to the fingerprint/graph/heal tests; -rfE: the names
    # of failures even if the limit cuts a process
    ( d=/tmp/res/tests30; mkdir -p $d; export TPGUARD_RENORM_GPU_TESTS=all
      for part in "kernels:tests/test_renorm_kernels.py" \
                  "rest:tests/test_renorm_reference.py tests/test_renorm_write_fp.py tests/test_renorm_plan.py tests/test_row_split.py" \
                  "pdl:tests/test_pdl.py"; do
        ( timeout 480 python3 -m pytest -q -rfE -p no:cacheprovider ${part#*:} > $d/${part%%:*}.log 2>&1
          say "GPU tests ${part%%:*} rc=$? $(tail -1 $d/${part%%:*}.log)" ) &
      done
      ( FP_NO_BENCH=1 FP_PYTEST=330 fingerprint ) &
      fi_jit &  # (session 10) for call31's flashinfer cells
      wait; grep -hE "^(FAILED|ERROR)" $d/*.log /tmp/res/fingerprint/pytest.log | cut -c1-200 | tee -a "$SUMMARY"
      # then, alone on the GPU: the one-tensor fingerprint at the default and the one-row tile, and the full set
      # (run 30 timed KernelConfig.last_finalize here too: slower, removed in session 10)
      w8=block_words=2048,num_warps=8,maxnreg=none; r1=rows_per_tile=1,chunk_words=32768
      FP_NO_PYTEST=1 FP_BENCH_TIMEOUT=120 FP_BENCH_ARGS="--shapes main --sweep --sweep-budget 40 --sweep-configs $w8|$w8,$r1 --full-set-configs many_long=table" fingerprint
      grep -E "^  block|best \(main|^main|many_long" /tmp/res/fingerprint/bench.log | cut -c1-200 | tee -a "$SUMMARY" )
    ;;
  call31)
    # <= 580 s (TAR_AT=560; carry .whl, .gpu): do the trimmed templates, or the plans' own graphs, win the eager
    # small-batch cells (run 27: top-k 1 / 8 rows 57 / 89 us vs flashinfer's 46, top-p 1 row 113 vs 88; host-bound)?
    # (plans' own graphs, kernels/renorm_graph.py: off by default then, on at <= 8 rows for >= 5 launches since
    # session 10; the host bench times them at every batch size, the eager batch-size cells run with them at <= 64)
    call31
    ;;
  call33)
    # session 10 (one machine start left for both): call31, then, while time is left, the guard bench on 1 GPU
    # (run 31: its full-mode graph with fingerprint_many's last_finalize 0 / 1 / 2 side by side, removed since)
    call31
    [ $(el) -lt 470 ] && guard_bench $(( 560 - $(el) ))
    ;;
  call34)
    # session 10's last (~450 s, TAR_AT=500; carry .whl, .gpu): alone on the GPU, the batch-size cells with today's
    # plan-graph rule (<= 8 rows, >= 5 launches) and with no graphs, and the guard bench after last_finalize's
    # removal; then every GPU test of the kernels and the fingerprint / graph / heal tests (pytest-xdist workers)
    ( d=/tmp/res/kernels34; mkdir -p $d
      for g in 8 0; do
        TPGUARD_RENORM_GRAPH_ROWS=$g timeout 120 python3 -m tpguard.bench.kernels --graphs --impls tpguard,flashinfer \
          --vocabs 163840 --logits flat --top-ks 40 --repeats 50 --json $d/bench_g$g.json > $d/bench_g$g.log 2>&1
        say "kernels bench (graph rows $g) rc=$?"; grep -A27 "^### batch sizes" $d/bench_g$g.log | grep tpguard | cut -c1-120 | tee -a "$SUMMARY"
      done
      grep -hE "^targets|^direct launches" $d/bench_g8.log | cut -c1-300 | tee -a "$SUMMARY" )
    guard_bench 60
    ( d=/tmp/res/tests34; mkdir -p $d; export TPGUARD_RENORM_GPU_TESTS=all
      x6=; x2=; python3 -c "import xdist" 2>/dev/null && { x6="-n 6"; x2="-n 2"; } || say "no pytest-xdist: one process each"
      timeout $(( 490 - $(el) )) python3 -m pytest -q -rfE -p no:cacheprovider $x6 tests/test_renorm_kernels.py \
        tests/test_pdl.py tests/test_renorm_reference.py tests/test_renorm_write_fp.py tests/test_renorm_plan.py \
        tests/test_row_split.py > $d/kernels.log 2>&1 &
      timeout $(( 490 - $(el) )) python3 -m pytest -q -rfE -p no:cacheprovider $x2 tests/test_gpu_guard_graphs.py \
        tests/test_heal_copy.py tests/test_fingerprint.py > $d/fingerprint.log 2>&1 &
      wait; say "GPU tests: kernels $(tail -1 $d/kernels.log); fingerprint $(tail -1 $d/fingerprint.log)"
      grep -hE "^(FAILED|ERROR)" $d/*.log | cut -c1-200 | tee -a "$SUMMARY" )
    ;;
  call35)
    # session 11 (~500 s, TAR_AT=560; carry .whl, .gpu): the one-launch top-k (kernels/renorm_top_k_fused.py): its
    # GPU tests, the in-process A/B against the three launches and flashinfer (gpu/fused_ab.py), the batch-size
    # cells; then every GPU test of the kernels (the shared select and write code changed)
    ( d=/tmp/res/fused35; mkdir -p $d
      timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_renorm_top_k_fused.py > $d/pytest.log 2>&1
      say "one-launch top-k GPU tests rc=$? $(tail -1 $d/pytest.log)"; grep -hE "^(FAILED|ERROR)" $d/pytest.log | cut -c1-300 | tee -a "$SUMMARY" )
    AB_TIMEOUT=150 BENCH_TIMEOUT=110 fused_cells /tmp/res/fused35
    gpu_tests /tmp/res/tests35 540 tests/test_renorm_kernels.py tests/test_pdl.py tests/test_renorm_reference.py \
      tests/test_renorm_write_fp.py tests/test_renorm_plan.py tests/test_row_split.py
    ;;
  call36)
    # session 11 (~330 s, TAR_AT=420): where an eager top-k call's host time goes (gpu/host_breakdown.py), the
    # one-launch kernel's knobs against the three launches (gpu/fused_variants.py), its GPU tests
    ( d=/tmp/res/fused36; mkdir -p $d
      timeout 60 python3 gpu/host_breakdown.py > $d/host.log 2>&1; say "host_breakdown rc=$?"; head -16 $d/host.log | tee -a "$SUMMARY"
      timeout 150 python3 gpu/fused_variants.py > $d/variants.log 2>&1; say "fused_variants rc=$?"; cut -c1-150 $d/variants.log | tee -a "$SUMMARY" )
    gpu_tests /tmp/res/fused36 400 tests/test_renorm_top_k_fused.py
    ;;
  call37)
    # session 11's last (~250 s, TAR_AT=260): the one-launch top-k with its final rule (chunks per CTA: one CTA per
    # SM; volatile waits): the A/B beside flashinfer, the batch-size cells, then its GPU tests and the plan tests
    # (run 35 ran every other GPU kernel test on the same select and write code: T37_MORE adds files)
    fused_cells /tmp/res/fused37
    gpu_tests /tmp/res/tests37 ${T37:-250} tests/test_renorm_top_k_fused.py tests/test_renorm_plan.py ${T37_MORE:-}
    ;;
  call38)
    # session 12 (~570 s, TAR_AT=585) the TMA probe (gpu/tma_probe.py: issue 3's fingerprint target, issue 6's
    # two-tensor lever), then the one-launch top-k above 8 rows (SGLang's bs x draft-token rows) before raising
    # RenormConfig.fused_rows
    ( d=/tmp/res/probe38; mkdir -p $d
      timeout 150 python3 gpu/tma_probe.py > $d/tma.log 2>&1; say "tma_probe rc=$?"; cut -c1-160 $d/tma.log | tee -a "$SUMMARY"
      timeout 150 python3 gpu/fused_variants.py --rows 8,16,32,64 --per 0 > $d/variants.log 2>&1
      say "fused_variants (8-64 rows) rc=$?"; cut -c1-150 $d/variants.log | tee -a "$SUMMARY" )
    # then every GPU test of the renorm kernels on the final code (session 11's last mends ran under the
    # interpreter only); .whl carries pytest-xdist since session 12
    gpu_tests /tmp/res/tests38 ${T38:-570} tests/test_renorm_top_k_fused.py tests/test_renorm_plan.py \
      tests/test_renorm_kernels.py tests/test_renorm_write_fp.py tests/test_row_split.py tests/test_pdl.py \
      tests/test_renorm_reference.py
    ;;
  call39)
    # session 12 (~560 s, TAR_AT=585; carry .whl, .gpu): the TMA lane launch in the product (kernels/fingerprint_tma.py):
    # the one-tensor call TMA vs ldg in one process, fingerprint_many's per-tensor launches through TMA on the
    # guard's full set, the guard's full mode with that config (run 39's code only: fingerprint_many has no TMA
    # since, so today those lane_tma=auto lines time the ldg rows kernel); then the fingerprint and guard GPU tests
    ( d=/tmp/res/tma39; mkdir -p $d; R=many_long=rows,block_words=2048,maxnreg=none
      timeout 170 python3 -m tpguard.bench.fingerprint --shapes main --sweep --sweep-budget 100 \
        --sweep-configs "block_words=2048,maxnreg=none,lane_tma=auto" \
        --full-set-configs "|$R|$R,lane_tma=auto|$R,lane_tma=auto,tma_warps=8|$R,lane_tma=auto,tma_stages=4" \
        > $d/fp.log 2>&1
      say "bench fingerprint rc=$?"; grep -A3 "^lane loads" $d/fp.log | tee -a "$SUMMARY"
      grep -E "^ +(set|decisions|full) |^  KernelConfig|^best|^main:|MISMATCH|ERROR" $d/fp.log | cut -c1-260 | tee -a "$SUMMARY"
      for c in "" "$R,lane_tma=auto"; do
        timeout 75 python3 -m tpguard.bench.guard --config "$c" > $d/guard_${c:+tma}.log 2>&1
        say "bench guard config '${c}' rc=$?"; grep -iE "full|decisions" $d/guard_${c:+tma}.log | cut -c1-200 | head -12 | tee -a "$SUMMARY"
      done )
    gpu_tests /tmp/res/tests39 ${T39:-575} tests/test_fingerprint.py tests/test_gpu_guard_graphs.py tests/test_heal_copy.py
    ;;
  call40)
    # session 12 (~250 s, TAR_AT=400; carry .whl, .gpu): one lane launch over the guard's two big tensors
    # (gpu/tma_probe.py --pair: issue 6's full mode with a foreign renorm), the final code's one-tensor numbers, the
    # fingerprint GPU tests on the final code (fingerprint_many without TMA again)
    ( d=/tmp/res/pair40; mkdir -p $d
      timeout 150 python3 gpu/tma_probe.py --pair > $d/pair.log 2>&1; say "tma_probe --pair rc=$?"
      cut -c1-160 $d/pair.log | tee -a "$SUMMARY"
      timeout 90 python3 -m tpguard.bench.fingerprint --shapes main > $d/fp.log 2>&1; say "bench fingerprint rc=$?"
      grep -A3 -E "^lane loads" $d/fp.log | tee -a "$SUMMARY"; grep -E "^ +(decisions|full) |^main:" $d/fp.log | tee -a "$SUMMARY" )
    gpu_tests /tmp/res/tests40 ${T40:-390} tests/test_fingerprint.py tests/test_gpu_guard_graphs.py
    ;;
  call41)
    # session 12's last (~250 s, TAR_AT=260; carry .whl, .gpu): the audit on today's code, 1,000 calls at 8 rows (the
    # one-launch top-k of session 11) and 300 at 256 rows, then the audit's GPU tests
    ( d=/tmp/res/audit41; mkdir -p $d
      for rc in 8:1000 256:300; do
        timeout 90 python3 -m tpguard.audit --calls ${rc#*:} --device cuda --rows ${rc%:*} --vocab 163840 \
          > $d/audit${rc%:*}.log 2>&1
        say "audit rows=${rc%:*} calls=${rc#*:} rc=$?"; cut -c1-160 $d/audit${rc%:*}.log | tail -25 | tee -a "$SUMMARY"
      done )
    gpu_tests /tmp/res/tests41 ${T41:-250} tests/test_audit.py
    ;;
  *)
    for p in ${PHASES//,/ }; do "$p"; done
    ;;
esac

say "done"
[ -n "$TAR_PID" ] && { pkill -P "$TAR_PID" 2>/dev/null; kill "$TAR_PID" 2>/dev/null; }
tar czf "$OUT/results.tgz" -C /tmp res 2>/dev/null
cp "$SUMMARY" "$OUT/summary.txt"
ls -la "$OUT"
cat "$SUMMARY"
