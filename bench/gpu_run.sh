#!/usr/bin/env bash
# The GPU benchmarks of record (docs/BENCHMARKS.md), in groups of under 10 minutes each (the
# device tool's limit per command). Run from the repository root on a machine with one or
# two GPUs; with two, the pipeline puts the producer and the consumer on different GPUs.
# Targets are random-weight models of real shapes built on the machine: nothing is downloaded.
#
#   bash bench/gpu_run.sh producer    # bf16 matmul ceiling; capture of packed data; producer dry run
#   bash bench/gpu_run.sh drafter     # drafter step (flex and sdpa, --fuse on), fixed and varying shapes
#   bash bench/gpu_run.sh pipeline    # batch staging checks; producer + broker + consumer vs each alone,
#                                     # on two GPUs and both roles on one
#   bash bench/gpu_run.sh transport   # CPU only: relay vs direct at 1-256 MiB; several peers through one broker
#   bash bench/gpu_run.sh tau         # regeneration speed; tau and speedup of a drafter trained online
#
# The work sessions' parts behind bench/reports/ are bench/gpu_sessions.sh. Results:
# $OUT/results_<track>.jsonl (one JSON object per line, each with "stage"), the stage logs in
# $OUT/logs_<group>.tgz; inputs are built in $DFLASH_GPU_WORK.
set -uo pipefail
PART=${1:?usage: gpu_run.sh producer|drafter|pipeline|transport|tau}
source "$(dirname "$0")/gpu_lib.sh"

producer() {
  inputs
  stage a ceiling 60 python3 -c "
import json, torch
from dflash.runtime.gpu import matmul_ceiling_tflops
r = [round(matmul_ceiling_tflops(torch.device('cuda', $G0), n), 1) for n in (4096, 8192, 16384)]
print(json.dumps({'gpu': $G0, 'bf16_matmul_tflops_4k_8k_16k': r}))"
  stage a capture_packed_flex 240 python3 bench/capture_gpu.py --target "$T8" --data "$W/packed.jsonl" \
      --token-budget 49152 --attn flex_attention --batches 12
  stage a producer_dry_run_packed 200 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/packed.jsonl" \
      --producer-gpu $G0 --parts producer_alone --token-budget 49152 --limit 2500 --seconds 170
}

drafter() {  # on two GPUs the fixed and the varying shapes run side by side, one per GPU
  local d="python3 bench/drafter_step.py --block-size 16 --anchors 512 --seq-len 3072 --skip-check --fuse on"
  fixed() {
    stage b drafter_flex_fuse_4x3072 200 $d --steps 10 --gpu $G1 --seqs 4 --attn flex
    stage b drafter_sdpa_fuse_4x3072 120 $d --steps 10 --gpu $G1 --seqs 4 --attn sdpa
  }
  varying() {
    stage d drafter_flex_fuse_vary 180 $d --steps 12 --gpu $G0 --seqs 4 --attn flex --vary
    stage d drafter_sdpa_fuse_vary 150 $d --steps 12 --gpu $G0 --seqs 4 --attn sdpa --vary
  }
  if [ "$NGPU" -gt 1 ]; then fixed & varying; wait; else fixed; varying; fi
}

pipeline() {
  [ -f "$T8/config.json" ] && [ -f "$W/long.jsonl" ] || inputs
  stage e gpu_checks 120 python3 bench/gpu_checks.py --device cuda:$G0
  stage e pipeline_flex_fuse 330 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/long.jsonl" \
      --producer-gpu $G0 --consumer-gpu $G1 --token-budget 12288 --seconds 100 --attn flex --fuse on
  # Both roles on GPU 0: the bound is 1 / (1/P + 1/C) of the figures just measured alone.
  stage f pipeline_shared_gpu_long 330 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/long.jsonl" \
      --producer-gpu $G0 --consumer-gpu $G0 --token-budget 12288 --seconds 220 --attn flex --fuse on --parts pipeline
}

transport() {
  local long=(--sizes 1,16 --gb 4 --max-messages 20000)
  stage r transport_small 180 python3 bench/transport.py "${long[@]}" --repeat 4 --out "$OUT/transport_small.json"
  stage r transport_large 150 python3 bench/transport.py --sizes 64,256 --repeat 2 --out "$OUT/transport_large.json"
  stage r scaling_64 100 python3 bench/scaling.py --layouts 5x3 --mib 64 --gb 16 --out "$OUT/scaling_64.json"
  stage r scaling_16 100 python3 bench/scaling.py --layouts 2x2,5x3 --mib 16 --gb 16 --out "$OUT/scaling_16.json"
}

tau() {
  stage c target06b 120 python3 bench/gpu_setup.py target --shape qwen3-0.6b --out "$T06"
  stage c regen_speed_loop 120 python3 bench/gpu_regen.py --target "$T06" --gpu $G1 --batches 16,64 --new-tokens 64
  stage c tau_fast_regen 420 python3 bench/gpu_tau.py --target "$T06" --producer-gpu $G1 --consumer-gpu $G1 \
      --epochs 200 --train-timeout-s 220 --eval-rows 20 --max-new-tokens 64 --eval-dtype float32
}

case $PART in
  producer|drafter|pipeline|transport|tau) $PART ;;
  *) echo "unknown group $PART (producer|drafter|pipeline|transport|tau)" >&2; exit 2 ;;
esac
tar czf "$OUT/logs_$PART.tgz" -C "$W" logs $(cd "$W" && ls -d pipeline/*/*.out tau/*/*.out tau/*/*.json 2>/dev/null)
echo "done $PART in ${SECONDS}s"
