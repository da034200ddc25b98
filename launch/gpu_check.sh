#!/usr/bin/env bash
# GPU check of the TP harness (issue 4), for one H200 with 2 ranks sharing it (gloo).
#
#   OUT=/some/dir bash launch/gpu_check.sh          # PYTHON=..., STEPS=2000, BUDGET_S=230 to override
#   DRY=1 STEPS=20 SHORT=10 bash launch/gpu_check.sh  # CPU smoke test of the script (emulated kernels)
#
# At 256 rows x 163840 vocab (--bs 32 --draft-tokens 8), top_p 0.9, flat logits:
#   flashinfer (default, atomicAdd)  -> divergences named target_probs (short run)
#   flashinfer + heal                -> divergences healed, outputs identical (short run)
#   flashinfer-det, torch, tpguard   -> no divergence over STEPS (>= 2000) steps
# Prints divergence counts and per-step times (with and without the guard's share), and writes
# one summary JSON per run plus $OUT/gpu_check.json. Runs are skipped (and marked so) when the
# time budget would be exceeded, so the whole script stays under ~4 minutes.
set -u -o pipefail

PYTHON=${PYTHON:-python3}
OUT=${OUT:-./gpu-check-out}
STEPS=${STEPS:-2000}
SHORT=${SHORT:-300}
BUDGET_S=${BUDGET_S:-230}
mkdir -p "$OUT"
START=$(date +%s)

COMMON=(--device cuda --backend gloo --bs 32 --draft-tokens 8 --vocab 163840 --logits flat --top-p 0.9
        --no-progress --timeout 120)
FI=flashinfer; FI_DET=flashinfer-det
if [[ -n "${DRY:-}" ]]; then  # CPU smoke test of this script itself: small shapes, emulated kernels
  COMMON=(--device cpu --bs 8 --draft-tokens 4 --vocab 4096 --logits flat --top-p 0.9 --no-progress --timeout 60)
  FI=emulated-atomic; FI_DET=torch
fi

[[ -n "${DRY:-}" ]] || "$PYTHON" - <<'EOF' || { echo "gpu_check: torch with CUDA is required" >&2; exit 2; }
import torch, sys
assert torch.cuda.is_available(), "no GPU"
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.device_count()} GPU(s)")
try:
    import time
    import flashinfer
    from flashinfer import sampling
    t = time.time()  # warm flashinfer's JIT/AOT modules now, not inside a timed, deadline-bounded run
    p = torch.softmax(torch.randn(256, 163840, device="cuda"), -1)
    for det in (False, True):
        sampling.top_p_renorm_probs(p, 0.9, is_deterministic=det)
        sampling.top_k_renorm_probs(p, 40, is_deterministic=det)
    torch.cuda.synchronize()
    print(f"gpu_check: flashinfer {flashinfer.__version__} (kernels ready in {time.time() - t:.1f} s)")
except Exception as e:
    print(f"gpu_check: flashinfer not usable ({e}); its runs will fail with exit 2")
EOF

run() {  # name steps expected-exit args...
  local name=$1 steps=$2 want=$3; shift 3
  local now; now=$(date +%s)
  if (( now - START > BUDGET_S )); then
    echo "gpu_check: $name skipped (time budget ${BUDGET_S}s used)"
    echo "{\"name\": \"$name\", \"skipped\": true}" > "$OUT/$name.json"
    return
  fi
  local t0; t0=$(date +%s.%N)
  "$PYTHON" -m tpguard.cli launch --nproc-per-node 2 "${COMMON[@]}" --steps "$steps" \
      --trace "$OUT/$name.trace" --summary-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local t1; t1=$(date +%s.%N)
  "$PYTHON" - "$OUT/$name.json" "$name" "$rc" "$want" "$t0" "$t1" <<'EOF'
import json, sys
path, name, rc, want, t0, t1 = sys.argv[1:]
try:
    d = json.load(open(path))
except Exception:
    d = {}
d.update(name=name, exit_code_seen=int(rc), exit_code_expected=int(want), wall_s=round(float(t1) - float(t0), 1))
json.dump(d, open(path, "w"), indent=1)
first = d.get("first_divergence") or {}
print(f"gpu_check: {name:16s} rc={rc} (want {want})  steps {d.get('steps_done')}/{d.get('steps_planned')}  "
      f"divergences {d.get('divergences')} (first: step {first.get('step')} {first.get('quantity')} "
      f"culprit {first.get('culprit_ranks')}; decision flips {d.get('decision_flips')})  "
      f"healed {d.get('actions', {}).get('healed', 0)}  outputs identical {d.get('outputs_identical')}  "
      f"{d.get('ms_per_step')} ms/step ({d.get('guard_ms_per_step')} ms guard)  wall {d['wall_s']} s")
EOF
}

START=$(date +%s)  # the budget covers the runs, not the warm-up above
run flashinfer      "$SHORT" 1 --renorm "$FI"
run flashinfer-det  "$STEPS" 0 --renorm "$FI_DET"
run tpguard         "$STEPS" 0 --renorm tpguard
run torch           "$STEPS" 0 --renorm torch
run flashinfer-heal "$SHORT" 0 --renorm "$FI" --on-divergence heal

"$PYTHON" - "$OUT" "$STEPS" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = int(sys.argv[2])
runs = {}
for name in ("flashinfer", "flashinfer-heal", "flashinfer-det", "torch", "tpguard"):
    p = out / f"{name}.json"
    runs[name] = json.loads(p.read_text()) if p.exists() else {"missing": True}
ok = (runs["flashinfer"].get("divergent_quantities", {}).get("target_probs", 0) > 0
      and all(runs[n].get("divergences") == 0 and runs[n].get("steps_done", 0) >= steps
              for n in ("flashinfer-det", "torch", "tpguard")))
(out / "gpu_check.json").write_text(json.dumps({"ok": ok, "runs": runs}, indent=1))
print(f"gpu_check: {'OK' if ok else 'NOT OK'}: flashinfer diverges in target_probs, flashinfer-det/torch/tpguard "
      f"clean over {steps} steps; results in {out}/gpu_check.json")
EOF
echo "gpu_check: total $(( $(date +%s) - START )) s"
