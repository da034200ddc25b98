#!/usr/bin/env bash
# GPU check of `tpguard replay`: the harness on one GPU (2 ranks sharing it over gloo) with
# flashinfer's default renorm and --dump, then `tpguard replay --device cuda` on its dumps.
#
#   OUT=/some/dir bash gpu/replay_check.sh        # PYTHON=..., CALLS=100, TRACE=/tmp/... to override
#   DRY=1 OUT=/tmp/x bash gpu/replay_check.sh     # CPU smoke test of this script (emulated atomics)
#
# At 256 rows x 163840 vocab (--bs 32 --draft-tokens 8), flat logits, two runs:
#   top_p 0.9              -> flashinfer top_p_renorm_probs (AIR radix) re-run CALLS times
#   top_k 40 then top_p 0.9 -> top_k_renorm_probs (multi-CTA radix), then top_p, one at a time
# Each replay re-runs the renorm on the ranks' agreed target_logits with flashinfer (default),
# flashinfer is_deterministic, tpguard's kernels and torch, and prints for docs/benchmarks.md:
# calls differing from the first per backend, which calls reproduce the culprit's bytes, the
# verdict and exit code, the replay's wall time. Summaries go to $OUT; the dumps (about 1.3 GB a
# run) stay in $TRACE, outside $OUT.
set -u -o pipefail

PYTHON=${PYTHON:-python3}
OUT=${OUT:-./replay-check-out}
TRACE=${TRACE:-/tmp/tpguard-replay-check}
CALLS=${CALLS:-100}
mkdir -p "$OUT"
rm -rf "$TRACE"
mkdir -p "$TRACE"

COMMON=(--steps 2 --device cuda --backend gloo --bs 32 --draft-tokens 8 --vocab 163840 --logits flat
        --renorm flashinfer --no-progress --quiet --timeout 300 --dump)
DEVICE=cuda
if [[ -n "${DRY:-}" ]]; then  # small shapes on the CPU, emulated atomics in flashinfer's place
  COMMON=(--steps 2 --device cpu --bs 8 --draft-tokens 4 --vocab 4096 --logits flat --renorm emulated-atomic
          --no-progress --quiet --timeout 60 --dump)
  DEVICE=cpu
  CALLS=${DRY_CALLS:-10}
fi

"$PYTHON" -c "import safetensors" 2>/dev/null || {
  echo "replay_check: the dumps need safetensors (a tpguard dependency): add its wheel (cp312 manylinux) to .whl/" >&2
  exit 2; }
[[ -n "${DRY:-}" ]] || "$PYTHON" - <<'EOF' || { echo "replay_check: torch with CUDA and flashinfer are required" >&2; exit 2; }
import time

import torch

assert torch.cuda.is_available(), "no GPU"
import flashinfer
from flashinfer import sampling

t = time.time()  # build/load flashinfer's kernels now, not inside the deadline-bounded harness
p = torch.softmax(torch.randn(256, 163840, device="cuda"), -1)
for det in (False, True):
    sampling.top_p_renorm_probs(p, 0.9, is_deterministic=det)
    sampling.top_k_renorm_probs(p, 40, is_deterministic=det)
torch.cuda.synchronize()
print(f"replay_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"flashinfer {flashinfer.__version__} (kernels ready in {time.time() - t:.1f} s)")
EOF

since() { "$PYTHON" -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$1"; }  # no bc there

check() {  # name harness-args...
  local name=$1; shift
  local t0 rc
  t0=$(date +%s.%N)
  "$PYTHON" -m tpguard.cli launch --nproc-per-node 2 "${COMMON[@]}" "$@" --trace "$TRACE/$name" \
      --summary-json "$OUT/$name.harness.json"
  rc=$?
  echo "replay_check: $name: harness exit $rc in $(since "$t0") s" \
       "($(du -sh "$TRACE/$name/dumps" 2>/dev/null | cut -f1) of dumps)"
  t0=$(date +%s.%N)
  "$PYTHON" -m tpguard.cli replay "$TRACE/$name" --device "$DEVICE" --calls "$CALLS" > "$OUT/$name.replay.txt"
  rc=$?
  local wall; wall=$(since "$t0")
  "$PYTHON" -m tpguard.cli replay "$TRACE/$name" --device "$DEVICE" --calls "$CALLS" --json > "$OUT/$name.replay.json"
  cat "$OUT/$name.replay.txt"
  echo "replay_check: $name: tpguard replay exit $rc in $wall s"
  "$PYTHON" - "$OUT/$name.replay.json" "$name" "$rc" "$wall" <<'EOF'
import json, sys

j = json.load(open(sys.argv[1]))
name, rc, wall = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])


def rows_found(r):
    got = [f"rank {k}: {sum(c is not None for c in rows.values())} of {len(rows)}"
           for k, rows in r["rows_reproduced"].items() if rows]
    return ", ".join(got) or "-"


rows = [f"| {name} | {r['label']} | {r['differing']} of {r['calls']} | "
        f"{', '.join(f'rank {k}: call {v}' for k, v in r['reproduced_by'].items() if v) or '-'} | "
        f"{rows_found(r)} | {r['seconds']:.2f} s |" for r in j["runs"] + j["kernels"] if not r.get("error")]
rows += [f"| {name} | {r['label']} | not run: {r['error']} | | | |" for r in j["runs"] if r.get("error")]
print("| run | backend / kernel | calls differing from the first | whole tensor reproduced by | "
      "differing rows reproduced | time |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
print(f"replay_check: {name}: step {j['step']}, first differing {j['first_differing']}, verdict {j['verdict']} "
      f"(exit {rc}), reproduced {j['reproduced']}, {wall:.1f} s wall")
EOF
}

check top_p --top-p 0.9
check top_k_top_p --top-k 40 --top-p 0.9
ls "$OUT"
