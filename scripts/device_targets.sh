# shellcheck shell=bash
# The measurements that issues 19 and 22 name, in one device call after the wheels' setup.
#
#   call 1: carry [".whl/a"]   command: source scripts/device_setup.sh
#   call 2: carry [".whl/b"]   command: source scripts/device_setup.sh
#   call 3: carry [".whl/c"]   command: bash scripts/device_targets.sh
#
# In order of what the issues need most, each cut at its own time limit so that what ran
# still comes back under $OUT (endpoint.log, and endpoint.md once the endpoint part ends;
# tutorial.txt; large.txt and profile/ with the profiler's tables):
#   1. the whole endpoint and the model path alone, batch 1 / 64 / 256, one gRPC client
#      (issue 19: 2.0 / 2.5 / 3.5 ms and 1.5 ms on the H200);
#   2. the tutorial preset, batch 384, d_model 64: T4R's Trainer, ours, fit, cached
#      (issue 22: 0.85 of cached, 2.5x T4R's Trainer);
#   3. the large preset, batch 1024, d_model 128, with fit in bf16 and the torch profiler's
#      step summary of fit and fit-bf16 (issue 22: AMP as fast as fp32, or why not).
# Seconds per part: ENDPOINT_S, TUTORIAL_S, LARGE_S (170, 150, 170: with the install, under
# the call's 600 s). DEVICE=cpu tries the script here: no setup, the endpoint on the CPU
# (the training benchmark picks its own device).
set -u
out="${OUT:-/tmp/device_targets}"
mkdir -p "$out"
if [ "${DEVICE:-cuda}" = cuda ]; then  # here, the project's own .venv is active instead
  # shellcheck source=scripts/device_setup.sh
  source scripts/device_setup.sh > "$out/setup.log" 2>&1 || { tail -5 "$out/setup.log"; exit 1; }
  tail -2 "$out/setup.log"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no GPU"
lscpu | grep "Model name"
git log --oneline -1

timeout -k 10 "${ENDPOINT_S:-170}" python3 benchmarks/endpoint.py --device "${DEVICE:-cuda}" \
  --paths model-lean,endpoint-lean --concurrency 1 --rounds 2 --seconds 2 \
  --output "$out/endpoint.md" > "$out/endpoint.log" 2>&1
echo "endpoint: exit $?"
# endpoint.md is written at the end; a cut run's rows are in the log
grep "^|" "$out/endpoint.md" 2>/dev/null || grep "^|" "$out/endpoint.log"

training() {  # preset, seconds, file, then benchmarks/training.py's other arguments
  local preset=$1 seconds=$2 file=$3
  shift 3
  timeout -k 10 "$seconds" python3 benchmarks/training.py --preset "$preset" --time-limit 2 "$@" \
    2>&1 | grep -v -i "warn\|projecting" > "$out/$file"
  echo "$preset: exit ${PIPESTATUS[0]}"
  grep "^|\|a step:" "$out/$file"
}
training tutorial "${TUTORIAL_S:-150}" tutorial.txt --rounds 2 \
  --paths t4r-trainer,trainer,fit,cached
training large "${LARGE_S:-170}" large.txt --rounds 1 --paths trainer,fit,fit-bf16,cached \
  --profile "$out/profile" --profile-paths fit,fit-bf16 --profile-steps 10
rm -f "$out"/profile/*.trace.json  # tens of MiB each; the tables (fit.txt, ...) stay
