#!/usr/bin/env bash
# GPU checks of the renorm kernels (issue 3), in one device call; see kernels/NOTES.md.
#   device run: bash kernels/gpu_check.sh     carry: [".whl", ".gpu"]
# .gpu/flashinfer-jit/sampling.so (flashinfer's sampling module, built on an H200 by an earlier
# run, 4 MB) loads as an AOT module: no 100 s JIT build competing with the timings. Python runs
# with -P so that the repo's own tpguard/ (without the kernels/ mapping) does not shadow the shim.
# Needs in .whl/: the slim flashinfer-python 0.7.2.post1 wheel and apache-tvm-ffi (cp312).
# Writes logs and JSON under $OUT (at most 8 files); prints short tables last. About 7 minutes.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_check_out}; mkdir -p "$OUT" /tmp/misc
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 FLASHINFER_CUDA_ARCH_LIST=9.0a TRITON_INTERPRET=0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /tmp/misc/pip.log 2>&1 || { echo "wheel install failed"; tail -5 /tmp/misc/pip.log; }
# tpguard without a build: a package folder whose subpackages point at kernels/, hooks/, launch/
mkdir -p /tmp/shim/tpguard
for f in tpguard/*; do ln -sfn "$PWD/$f" /tmp/shim/tpguard/; done
for d in kernels hooks launch; do ln -sfn "$PWD/$d" /tmp/shim/tpguard/$d; done
export PYTHONPATH=/tmp/shim:/tmp/site:$PWD
# a flashinfer sampling module built by an earlier call loads as an AOT module (no 100 s JIT)
if [ -f .gpu/flashinfer-jit/sampling.so ]; then
  mkdir -p /tmp/site/flashinfer/data/aot/sampling && cp .gpu/flashinfer-jit/sampling.so /tmp/site/flashinfer/data/aot/sampling/
fi
{ nvidia-smi; python3 -P -c "import torch, triton, tpguard.kernels.renorm; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } > /tmp/misc/env.txt 2>&1
tail -1 /tmp/misc/env.txt

# 1. flashinfer's sampling module, built in the background (about 100 s), then packed for reuse
( python3 -P -c "import flashinfer, flashinfer.sampling as s; s.get_sampling_module(); print('flashinfer', flashinfer.__version__, 'sampling module ready')" \
    > /tmp/misc/flashinfer_build.log 2>&1 && touch /tmp/fi_ready
  so=$(find ~/.cache/flashinfer /tmp/site/flashinfer/data/aot -name sampling.so 2>/dev/null | head -1)
  if [ -n "$so" ] && [ ! -f .gpu/flashinfer-jit/sampling.so ]; then gzip -9 -c "$so" > /tmp/misc/sampling.so.gz
    ls -la "$so" /tmp/misc/sampling.so.gz >> /tmp/misc/flashinfer_build.log
    split -b 15M -d /tmp/misc/sampling.so.gz "$OUT/flashinfer-sampling.so.gz.part"; fi ) &

# 2. the kernel tests on the GPU: the smoke set (bench shapes + special rows; about 40-60 s of
#    Triton compiles, which the sweep and bench then reuse); TPGUARD_RENORM_GPU_TESTS=all runs all
echo "[$(el)s] pytest"
timeout 100 python3 -P -m pytest -q -p no:cacheprovider --maxfail=3 tests/test_renorm_kernels.py tests/test_renorm_reference.py \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"; tail -4 "$OUT/pytest.log"

# 3. block-shape variants and per-pass times; the fastest variant is used for the table
echo "[$(el)s] sweep"
timeout 80 python3 -P kernels/gpu_sweep.py --budget 50 --json "$OUT/sweep.json" 2>&1 | tee /tmp/misc/sweep.log
BEST=$(python3 - "$OUT/sweep.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except Exception:
    print(""); sys.exit(0)
r, VARIANTS = data["variants"], data["configs"]
keys = ("top_p_flat", "top_k40_flat", "top_k_top_p_flat", "top_p_peaky")
ok = {v: sum(c[k]["us"] for k in keys) for v, c in r.items()
      if all(k in c and "us" in c[k] and c[k]["same_kept_as_reference"] for k in keys)}
best = min(ok, key=ok.get) if ok else "default"
print(f"best variant {best}: {ok.get(best)}", file=sys.stderr)
print(",".join(f"{k}={v}" for k, v in VARIANTS[best].items()))
PY
)
echo "TPGUARD_RENORM_CONFIG='${BEST}'" | tee /tmp/misc/best_config.txt
export TPGUARD_RENORM_CONFIG="$BEST"

# 4. the issue's table: tpguard vs flashinfer (default, deterministic) vs torch
for i in $(seq 1 30); do [ -f /tmp/fi_ready ] && break; sleep 2; done
IMPLS=tpguard,flashinfer,flashinfer-det,torch; [ -f /tmp/fi_ready ] || { IMPLS=tpguard,torch; echo "flashinfer not built in time"; }
echo "[$(el)s] bench ($IMPLS)"
timeout 150 python3 -P -m tpguard.bench.kernels --graphs --impls "$IMPLS" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"

# 5. determinism / batch-invariance audit of every kernel found
echo "[$(el)s] audit"
timeout 60 python3 -P -m tpguard.audit --calls 200 --device cuda --rows 256 --vocab 163840 > "$OUT/audit.log" 2>&1
echo "audit rc=$?"
wait
tar czf "$OUT/misc.tgz" -C /tmp misc/pip.log misc/env.txt misc/flashinfer_build.log misc/sweep.log misc/best_config.txt 2>/dev/null
echo "[$(el)s] done"; ls -la "$OUT"
grep -E "^\| (top_p|top_k|top_k_top_p|min_p) \| (128256|163840) " "$OUT/bench.log" | grep -v flashinfer-det | head -48
grep -E "targets|copy floor|Error|error" "$OUT/bench.log" | head -8
grep -E "NON-DET|deterministic" "$OUT/audit.log" | grep -v "not available" | cut -c1-110 | head -24
