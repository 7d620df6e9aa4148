#!/usr/bin/env bash
# Regeneration speed and the small-target drafter step on one GPU machine that keeps /tmp
# only while warm and runs one command for at most 10 minutes: two calls in a row.
#
#   bash bench/gpu_regen_step.sh install   # carry .whl/ and .carry/part-a: wheels into /tmp/site
#   bash bench/gpu_regen_step.sh run       # carry .carry/part-b: join the GGUF, then
#                                          # bench/regen_speed.py and bench/drafter_step.py
#                                          # (SmolLM2 shape, varying batches, profiled)
# Results in $OUT: regen.json, step.jsonl, step_profile.txt.
set -uo pipefail
W=/tmp/dflash-regen
. "$(dirname "$0")/gpu_carry.sh"  # OUT, GGUF, the environment
case "${1:?usage: gpu_regen_step.sh install|run}" in
install)
  gpu_install || exit 1
  ;;
run)
  gpu_join || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  timeout --kill-after=10 "${REGEN_S:-400}" python3 bench/regen_speed.py --gguf "$GGUF" --out "$OUT/regen.json" \
      ${REGEN_ARGS:-} 2> "$W/regen.err" | cut -c1-600
  echo "regen rc=$?"; grep -v Warning "$W/regen.err" | tail -5 | cut -c1-300
  timeout --kill-after=10 "${STEP_S:-130}" python3 bench/drafter_step.py --shape smollm2-135m --seqs 16 --seq-len 290 \
      --vary --steps 24 --profile 4 --skip-check ${STEP_ARGS:-} > "$OUT/step_profile.txt" 2> "$W/step.err"
  echo "step rc=$?"; grep '^{' "$OUT/step_profile.txt" | grep -v '"stage"' | tee "$OUT/step.jsonl" | cut -c1-600
  tail -3 "$W/step.err" | cut -c1-300
  ;;
esac
