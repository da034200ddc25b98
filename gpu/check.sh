#!/usr/bin/env bash
# tpguard's GPU check: the GPU tests and the benchmarks behind docs/benchmarks.md, in named phases.
# Each phase prints its numbers and writes its tables of docs/benchmarks.md as markdown to
# $OUT/<phase>.md (gpu/phase_tables.py); $OUT/summary.txt gathers every phase's short lines and
# $OUT/logs.tgz every log and JSON file (the host phase writes $OUT/host.txt, its raw output). At most 8
# files come back from $OUT: 6 phases + these 2; run the other phases in calls of their own.
#
#   bash gpu/fetch_wheels.sh                                  # once, on a machine with network
#   device run, carry [".whl", ".gpu"]:   PHASES=kernels bash gpu/check.sh
#
# Phases (PHASES=a,b,...; default: all six in this order). One device call may last 600 s, so run
# them in groups; the times are what they took on one H200 (two for the NCCL parts):
#   tests        the whole suite, as on CPU: python -m pytest tests (pytest-xdist from .whl, --dist load, one
#                worker per 14 GiB of GPU memory, at most 8); the kernel tests on the GPU, the interpreter's
#                skip, saying why                                                               ~300 s,
#                ~510 s with flashinfer's own renorm tests (.gpu/flashinfer/test_sampling.py); on an H100
#                host over 543 s with a cold Triton cache, 186 s warm (a second call on the same machine);
#                TESTS="tests/test_a.py ..." runs those files instead of tests/
#   kernels      bench kernels (the renorm table beside flashinfer, batch sizes, top_k sweep), the determinism table
#                (1,000 calls at 8 rows, 300 at 256), host time per eager call; with 2 GPUs the
#                cross-GPU bytes check                                  ~400 s, +100 s for flashinfer's JIT
#   fingerprint  bench fingerprint (one tensor: TMA and ldg lane loads; the guard's sets)        ~90 s
#   guard        bench guard on one GPU and the write pass's fingerprint (--fused-probs); with 2 GPUs
#                also over NCCL (fused heal included) and gpu/graph_nccl_check.py          ~150 s (+200 s)
#   harness      the TP harness at 256 x 163840, top_p 0.9, flat, DFlash: 2 GPUs over NCCL (five
#                2,000-step runs), else 2 ranks sharing one GPU over gloo                      ~300 s
#   sglang       sglang 0.5.23's verify functions under the plugin: every site over NCCL with 2 GPUs,
#                DFlash, DSpark and EAGLE (default, audit) with 2 ranks sharing one GPU otherwise ~300 s
#   speed        the harness's steady-state time per step without the guard, per renorm (one GPU) ~200 s
#   fix          policy fix with flashinfer's default renorm (one GPU): switched once, clean after ~60 s
#   replay       tpguard replay on a flashinfer run's dumps (gpu/replay_check.sh)                ~200 s
#   host         host time of an eager call, layer by layer, flashinfer's beside it (gpu/host_layers.py;
#                $OUT/host.txt)                                                                 ~100 s
# Groups that fit: nvidia-h200: PHASES=tests, PHASES=kernels, PHASES=fingerprint,guard;
#                  nvidia-h200-x2: PHASES=guard,harness, PHASES=sglang.
# LIMIT (default 580 s from the start): every command is cut so the call ends before it, and one
# that would get less than 20 s is skipped (and says so); what ran is still written and packed.
#
# .whl/: slim flashinfer-python 0.7.2.post1 + apache-tvm-ffi + the pure-Python / cp312 wheels that
#        sglang 0.5.23's hooked modules import, pytest-xdist (gpu/fetch_wheels.sh)
# .gpu/: sglang_py.zip (sglang 0.5.23's Python modules); flashinfer/test_sampling.py if there (flashinfer's
#        tests/utils/test_sampling.py, or its renorm functions: tests/test_flashinfer_own.py runs them);
#        flashinfer-jit/sampling.so if there (flashinfer's sampling module built on an H200: no ~100 s
#        JIT; the kernels phase returns it as $OUT/sampling.so
#        when it had to build it and a slot is free: copy it to .gpu/flashinfer-jit/)
set -u -o pipefail
OUT=${OUT:-/tmp/out}; RES=${RES:-/tmp/res}; mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TRITON_INTERPRET=0 OMP_NUM_THREADS=4
LIMIT=${LIMIT:-580}
T0=$(date +%s)
SUMMARY=$RES/summary.txt
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUMMARY"; }
# within SECONDS CMD...: run CMD under `timeout`, cut to end 10 s before LIMIT; skipped under 20 s.
within() {
  local want=$1 left; shift
  left=$(( LIMIT - ($(date +%s) - T0) - 10 ))
  (( left < want )) && want=$left
  if (( want < 20 )); then say "skipped (LIMIT ${LIMIT}s): ${*:0:6}"; return 124; fi
  timeout "$want" "$@"
}
table() {  # table PHASE: the phase's markdown from its results, into $OUT and onto stdout
  python3 gpu/phase_tables.py "$1" "$RES/$1" "$RES/env.json" > "$OUT/$1.md" 2> "$RES/$1/tables.err" \
    || say "$1: tables incomplete: $(tail -1 "$RES/$1/tables.err")"
  cat "$OUT/$1.md"
}

# --- set-up ---------------------------------------------------------------------------------------
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$RES/pip.log" 2>&1 || say "wheel install failed: $(tail -2 "$RES/pip.log")"
fi
# sglang's JIT verify kernel checks that flashinfer's cutlass include path exists (the slim wheel
# drops cutlass; the speculative-sampling kernel does not include it).
mkdir -p /tmp/site/flashinfer/data/cutlass/include /tmp/site/flashinfer/data/cutlass/tools/util/include
if [ -f .gpu/flashinfer-jit/sampling.so ]; then  # flashinfer 0.7.2.post1 loads it as an AOT module
  mkdir -p /tmp/site/flashinfer/data/aot/sampling && cp .gpu/flashinfer-jit/sampling.so /tmp/site/flashinfer/data/aot/sampling/
fi
[ -f .gpu/sglang_py.zip ] && python3 -c "import zipfile; zipfile.ZipFile('.gpu/sglang_py.zip').extractall('/tmp/sg')"
# The repo first: tpguard/__init__.py maps tpguard.kernels/.hooks/.launch to the top-level folders.
export PYTHONPATH=$PWD:/tmp/sg:/tmp/site
python3 - "$RES/env.json" <<'PY' 2> "$RES/env.err"
import json, platform, subprocess, sys, time
env = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "python": platform.python_version()}
try:
    env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    pass
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    if torch.cuda.is_available():
        env["gpu_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    import triton
    env["triton"] = triton.__version__
except Exception as e:  # noqa: BLE001
    env["error"] = str(e)
for mod in ("flashinfer", "sglang"):
    try:
        env[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001
        env[mod] = "not installed"
try:
    env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.split("\n")[0].strip()
except OSError:
    pass
json.dump(env, open(sys.argv[1], "w"), indent=1)
PY
say "$(python3 -c "import json; e=json.load(open('$RES/env.json')); print('env:', '; '.join(f'{k} {v}' for k, v in e.items()))" 2>&1)"
NGPU=$(python3 -c "import json; print(json.load(open('$RES/env.json')).get('gpus', 0))" 2>/dev/null || echo 0)
# Tests spread one by one (--dist load, not tests/conftest.py's loadfile): a kernel test module
# compiles hundreds of kernels here, too many for one worker. One worker per 14 GiB of the GPU, at most 8
# (8 when the size is unknown): each held 7.7-13.6 GiB in torch's caching allocator, and on an 80 GiB H100
# eight of them left a flashinfer test's 1.4 GiB batch out of memory.
GPU_GIB=$(python3 -c "import json; print(int(json.load(open('$RES/env.json')).get('gpu_gib', 0)))" 2>/dev/null || echo 0)
WORKERS=8; (( GPU_GIB > 0 && GPU_GIB / 14 < 8 )) && WORKERS=$(( GPU_GIB / 14 )); (( WORKERS < 1 )) && WORKERS=1
XDIST=; python3 -c "import xdist" 2> /dev/null && XDIST="-n $WORKERS --dist load"
export XDIST  # gpu/phase_tables.py writes it into the tests table's command

# --- phases ---------------------------------------------------------------------------------------
tests() {
  local d=$RES/tests; mkdir -p $d
  # shellcheck disable=SC2086
  TPGUARD_RENORM_GPU_TESTS=all within 560 python3 -m pytest ${TESTS:-tests} $XDIST -q -rfE -p no:cacheprovider \
    --junitxml=$d/junit.xml > $d/pytest.log 2>&1
  say "tests rc=$? $(tail -1 $d/pytest.log)"; grep -hE "^(FAILED|ERROR)" $d/pytest.log | cut -c1-200 | tee -a "$SUMMARY"
  table tests
}

flashinfer_so() {  # flashinfer's sampling module, JIT-built here, back as $OUT/sampling.so (for .gpu/flashinfer-jit/)
  [ -f .gpu/flashinfer-jit/sampling.so ] && return
  local so; so=$(find "$HOME/.cache/flashinfer" -name 'sampling*.so' -size -30M 2>/dev/null | head -1)
  [ -n "$so" ] && cp "$so" "$OUT/sampling.so" && say "flashinfer's JIT-built sampling.so is in \$OUT: copy it to .gpu/flashinfer-jit/"
}

kernels() {
  local d=$RES/kernels; mkdir -p $d
  within 300 python3 -m tpguard.bench.kernels --graphs --impls tpguard,flashinfer,flashinfer-det,torch \
    --json $d/bench.json > $d/bench.log 2>&1
  say "bench kernels rc=$? $(grep '^targets' $d/bench.log)"
  flashinfer_so
  for rc in 8:1000 256:300; do
    within 120 python3 -m tpguard.determinism --calls ${rc#*:} --device cuda --rows ${rc%:*} --vocab 163840 \
      > $d/determinism${rc%:*}.log 2>&1
    say "determinism rows=${rc%:*} calls=${rc#*:} rc=$?"
  done
  within 150 python3 gpu/renorm_host.py --gpu --batch-sizes 1,8,64 > $d/host.log 2>&1
  say "host time per eager call rc=$? $(tail -1 $d/host.log)"
  if [ "$NGPU" -gt 1 ]; then
    within 120 python3 gpu/cross_gpu_check.py $d/cross_gpu.json > $d/cross_gpu.log 2>&1
    say "cross-GPU rc=$? $(tail -1 $d/cross_gpu.log)"
  fi
  table kernels
}

fingerprint() {
  local d=$RES/fingerprint; mkdir -p $d
  within 150 python3 -m tpguard.bench.fingerprint --shapes main > $d/bench.log 2>&1
  say "bench fingerprint rc=$? $(grep '^main:' $d/bench.log)"
  table fingerprint
}

guard() {
  local d=$RES/guard; mkdir -p $d
  CUDA_VISIBLE_DEVICES=0 within 120 python3 -m tpguard.bench.guard --json $d/guard1.json > $d/guard1.log 2>&1
  say "bench guard (1 GPU) rc=$? $(grep -E 'device work' $d/guard1.log)"
  CUDA_VISIBLE_DEVICES=0 within 80 python3 -m tpguard.bench.guard --fused-probs --json $d/fused_probs.json \
    > $d/fused_probs.log 2>&1
  say "bench guard --fused-probs rc=$? $(grep -E 'write \+ fingerprint' $d/fused_probs.log | head -1)"
  if [ "$NGPU" -gt 1 ]; then
    within 150 torchrun --nproc-per-node 2 -m tpguard.bench.guard --json $d/guard2.json > $d/guard2.log 2>&1
    say "bench guard (2 GPUs, NCCL) rc=$? $(grep -E 'device work' $d/guard2.log)"
    TRACE_DIR=$d/graph_trace within 90 torchrun --nproc-per-node 2 gpu/graph_nccl_check.py $d/graph_nccl.json \
      > $d/graph_nccl.log 2>&1
    say "graph capture over NCCL rc=$? $(tail -1 $d/graph_nccl.log)"
  fi
  table guard
}

harness() {  # 256 verify rows x 163840, top_p 0.9, flat logits, DFlash chain; record, and heal for flashinfer
  local d=$RES/harness; mkdir -p $d
  local backend=nccl; [ "$NGPU" -gt 1 ] || backend=gloo  # gloo: 2 ranks share GPU 0
  echo "$backend" > $d/backend
  local common="--device cuda --backend $backend --bs 32 --draft-tokens 8 --vocab 163840 --logits flat --top-p 0.9
    --algo dflash --no-progress --timeout 120"
  local run name renorm policy
  for run in flashinfer:flashinfer:record flashinfer-heal:flashinfer:heal flashinfer-det:flashinfer-det:record \
             torch:torch:record tpguard:tpguard:record; do
    IFS=: read -r name renorm policy <<< "$run"
    # shellcheck disable=SC2086
    within 110 python3 -m tpguard.cli launch --nproc-per-node 2 $common --renorm $renorm --on-divergence $policy \
      --steps ${HARNESS_STEPS:-2000} --trace $d/$name.trace --summary-json $d/$name.json > $d/$name.log 2>&1
    say "harness $name ($backend) rc=$? $(grep -m1 -E 'divergences|outputs' $d/$name.log | cut -c1-160)"
    rm -rf $d/$name.trace
  done
  table harness
}

sglang_site() {  # DIR SITE CONFIGS [--nccl]: one sglang verify function under the plugin (its default configs if "")
  local d=$1 site=$2 configs=$3; shift 3
  within 280 python3 gpu/sglang_check.py $d/$site.json --site $site ${configs:+--configs $configs} "$@" \
    --timeout 150 > $d/$site.log 2>&1
  say "sglang $site rc=$? $(grep -E 'PASS|FAIL' $d/$site.log | head -1)"
}

sglang() {  # 12 steps of 256 rows x 128256, top_p 0.9, byte-identical inputs on both ranks
  local d=$RES/sglang; mkdir -p $d
  if [ "$NGPU" -gt 1 ]; then  # every site over NCCL, two chains side by side on the same two GPUs
    ( sglang_site $d dflash default,deterministic,audit --nccl; sglang_site $d eagle "" --nccl ) &
    ( sglang_site $d eagle-greedy "" --nccl; sglang_site $d sampler "" --nccl ) &
    wait
  else  # 2 ranks share one GPU over gloo: the three verify owners, aligned decisions and audit
    local site
    for site in ${SGLANG_SITES:-dflash dspark eagle}; do
      case $site in
        dflash) sglang_site $d dflash default,audit,deterministic --steps ${SGLANG_STEPS:-8} ;;
        *) sglang_site $d $site default,audit --steps ${SGLANG_STEPS:-8} ;;
      esac
    done
  fi
  table sglang
}

speed() {  # the harness's time per step without the guard, per renorm (bs 32 x 8 draft tokens, 163840)
  local d=$RES/speed; mkdir -p $d
  local common="--device cuda --backend gloo --bs 32 --draft-tokens 8 --vocab 163840 --logits flat --top-p 0.9
    --no-guard --no-progress --quiet --timeout 120 --steps ${SPEED_STEPS:-100}"
  local run name renorm env
  for run in flashinfer:flashinfer: tpguard:tpguard: tpguard-noplans:tpguard:TPGUARD_RENORM_PLANS=0 torch:torch:; do
    IFS=: read -r name renorm env <<< "$run"
    # shellcheck disable=SC2086
    ( [ -n "$env" ] && export $env; within 100 python3 -m tpguard.cli launch --nproc-per-node 2 $common \
      --renorm $renorm --summary-json $d/$name.json > $d/$name.log 2>&1 )
    say "speed $name rc=$? $(python3 -c "import json; j=json.load(open('$d/$name.json')); print(f\"{j['ms_per_step']} ms/step steady, warm-up {j['warmup_ms_per_step']} ms/step\")" 2>&1 | tail -1)"
  done
  # the renorm call plans alone, 2 processes sharing the GPU: first steps apart from the steady state
  within 120 python3 gpu/plans_shared_gpu.py --procs 2 --steps 100 > $d/plans.md 2> $d/plans.err
  say "speed plans rc=$? $(grep -E '^\| (on|off) ' $d/plans.md | tr -s ' ' | tr '\n' ';' | cut -c1-400)"
}

fix() {  # policy fix with flashinfer's default renorm: healed once, switched, clean after (one GPU, gloo)
  local d=$RES/fix; mkdir -p $d
  within 150 python3 -m tpguard.cli launch --nproc-per-node 2 --device cuda --backend gloo --bs 32 --draft-tokens 8 \
    --vocab 163840 --logits flat --top-p 0.9 --renorm flashinfer --on-divergence fix --steps ${FIX_STEPS:-200} \
    --no-progress --timeout 120 --trace $d/trace --summary-json $d/fix.json > $d/fix.log 2>&1
  say "fix rc=$? $(grep -E 'switched|divergences|outputs' $d/fix.log | tr -s ' ' | tr '\n' ';' | cut -c1-400)"
  python3 -m tpguard.cli diagnose $d/trace > $d/diagnose.log 2>&1
  say "fix diagnose: $(grep -E '^switched|DIVERGED|CLEAN' $d/diagnose.log | tr '\n' ';' | cut -c1-300)"
  rm -rf $d/trace
}

host() {  # host time of an eager call, layer by layer, flashinfer's beside it (gpu/host_layers.py), as $OUT/host.txt
  local d=$RES/host; mkdir -p $d
  within ${HOST_LIMIT:-200} python3 gpu/host_layers.py > $d/host_layers.txt 2>&1
  say "host rc=$? $(grep -cE '^  ' $d/host_layers.txt) rows"
  cp $d/host_layers.txt "$OUT/host.txt"; cat $d/host_layers.txt
}

replay() {  # tpguard replay on the dumps of a flashinfer run (gpu/replay_check.sh)
  local d=$RES/replay; mkdir -p $d
  OUT=$d PYTHON=python3 within ${REPLAY_LIMIT:-300} bash gpu/replay_check.sh > $d/log.txt 2>&1
  say "replay rc=$? $(grep -E 'verdict|differ' $d/log.txt | tr '\n' ';' | cut -c1-400)"
}

PHASE_LIST=${PHASES:-tests,kernels,fingerprint,guard,harness,sglang}
for p in ${PHASE_LIST//,/ }; do
  case $p in
    tests|kernels|fingerprint|guard|harness|sglang|speed|fix|replay|host) say "phase $p"; $p ;;
    *) say "unknown phase '$p' (tests, kernels, fingerprint, guard, harness, sglang, speed, fix, replay, host)" ;;
  esac
done

flashinfer_so  # flashinfer's JIT-built sampling module, back for .gpu/flashinfer-jit/ when it was built here
say "done"
cp "$SUMMARY" "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$(dirname "$RES")" "$(basename "$RES")" 2> /dev/null
(( $(ls "$OUT" | wc -l) > 8 )) && rm -f "$OUT/sampling.so"  # at most 8 files come back: the tables first
ls -la "$OUT"
