#!/usr/bin/env bash
# The device run of bench/gpu_check.py: one process per check, each under its own time limit, so a
# hang in one (a peer that never joins) costs that check alone and the rest still report. Run from
# the repo root on the device machine, with the wheels of bench/results/gpu_check_h200.md
# in .whl/ (the device's python3 has torch and transformers, not the rest of dapo's imports); the
# lora_step check also needs peft==0.21.2 and accelerate (pure-Python wheels: add them to that download).
#   run(carry=[".whl"], timeout_s=540, command="bash bench/gpu_check.sh 440")
# Writes $OUT/gpu_check.jsonl (one JSON line per check or learner variant) and $OUT/gpu_check.stderr.
set -uo pipefail
budget_s=${1:-440}
out=${OUT:-/tmp}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t0=$(date +%s)
# learner_step last: it takes what time is left and prints a line per variant as it goes.
for c in exactness bf16_step publish publish_direct cuda_ipc collective lora_step learner_step; do
  left=$((budget_s - ($(date +%s) - t0)))
  if [ "$left" -lt 20 ]; then echo "== $c: skipped, out of time"; continue; fi
  limit=$left; [ "$c" != learner_step ] && [ "$limit" -gt 120 ] && limit=120
  echo "== $c (limit ${limit}s) $(date +%T)"
  timeout "$limit" python3 bench/gpu_check.py --checks "$c" > >(tee -a "$out/gpu_check.jsonl") \
    2> >(tee -a "$out/gpu_check.stderr" | grep -v -i warn | tail -4 >&2)
  echo "rc=$?"
done
