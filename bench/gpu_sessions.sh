#!/usr/bin/env bash
# The GPU work sessions' parts, as they ran: the commands behind the dated reports in
# bench/reports/ (each part under 10 minutes, the device tool's limit per command). The
# benchmarks of record are bench/gpu_run.sh; this file keeps the history reproducible.
# Run from the repository root on a machine with one or two GPUs; with two, independent
# stages run side by side (one per GPU) and the pipeline puts the producer and the
# consumer on different GPUs.
#
#   bash bench/gpu_sessions.sh part1   # matmul ceiling; capture (uniform and packed data), producer
#                                 # dry run; drafter step (sdpa, flex) with MFU
#   bash bench/gpu_sessions.sh part2   # pipeline vs alone; CPU transport on this host's cores
#   bash bench/gpu_sessions.sh part3   # tau/speedup of a drafter trained online on a small target
#   bash bench/gpu_sessions.sh part4   # the drafter step with --fuse on (part34: 4 then 3)
#   bash bench/gpu_sessions.sh part5   # GPU checks of the consumer's batch staging; pipeline with the
#                                 # flex + fuse drafter on 2 GPUs, then both roles on one GPU
#   bash bench/gpu_sessions.sh part6   # regeneration speed; tau of a drafter trained online (one GPU);
#                                 # drafter step on varying shapes; broker with 1 vs 2 I/O threads
#   bash bench/gpu_sessions.sh part7   # regeneration with the greedy loop and tau again; the shared-GPU
#                                 # pipeline for longer; transport at 1 and 16 MiB
#   bash bench/gpu_sessions.sh part8   # CPU only: transport before (BASELINE_TAR, a `git archive` of an
#                                 # earlier commit) and after, 1 and 16 MiB; then 64 and 256 MiB
#   bash bench/gpu_sessions.sh part9   # CPU only: transport with senders sending new memory every message
#                                 # (--fresh-batches) and one buffer over and over, 1 and 16 MiB
#   bash bench/gpu_sessions.sh part10  # CPU only: 16 MiB through the broker, one knob at a time
#   bash bench/gpu_sessions.sh part11  # CPU only: transport at 1, 16, 64, 256 MiB as the code now stands
#   bash bench/gpu_sessions.sh part12  # CPU only: 1 and 16 MiB with a 64 MiB broker queue; with --fresh-batches
#   bash bench/gpu_sessions.sh part13  # CPU only: bench/scaling.py 1x1, 2x2, 5x3 at 64 MiB; 2x2, 5x3 at 16 MiB
#   bash bench/gpu_sessions.sh part14  # CPU only: transport at 1 and 16 MiB before (BASELINE_TAR) and after; after
#                                 # with one data stream per consumer; after with --fresh-batches
#   bash bench/gpu_sessions.sh part15  # CPU only: transport at 64 and 256 MiB; part13's scaling again
#   bash bench/gpu_sessions.sh part16  # CPU only: transport at 1 and 16 MiB before (BASELINE_TAR) and after, 4 GB
#                                 # per run; after with --fresh-batches; a profiled 1 MiB run
#   bash bench/gpu_sessions.sh part17  # CPU only: transport at 1 and 16 MiB before (BASELINE_TAR) and after (the
#                                 # ledger's own thread); 64 and 256 MiB; scaling 5x3 at 64 MiB, 2x2 and 5x3 at 16
#   bash bench/gpu_sessions.sh part18  # CPU only: transport at 1 and 16 MiB with producers on two data streams too;
#                                 # with --fresh-batches; scaling 5x3 at 16 MiB
#
# Results: $OUT/results_<track>.jsonl (one JSON object per line, each with "stage"), the
# stage logs in $OUT/logs_<part>.tgz. Inputs are built in $DFLASH_GPU_WORK (kept between
# parts while the machine is the same; rebuilt otherwise).
set -uo pipefail
PART=${1:?usage: gpu_sessions.sh part1..part18}
source "$(dirname "$0")/gpu_lib.sh"

part1_capture() {  # GPU0
  stage a ceiling 60 python3 -c "
import json, torch
from dflash.runtime.gpu import matmul_ceiling_tflops
r = [round(matmul_ceiling_tflops(torch.device('cuda', $G0), n), 1) for n in (4096, 8192, 16384)]
print(json.dumps({'gpu': $G0, 'bf16_matmul_tflops_4k_8k_16k': r}))"
  stage a capture_uniform_sdpa 200 python3 bench/capture_gpu.py --shape qwen3-8b --tokens 49152 \
      --seq-len 3072 --attn sdpa --reps 3
  stage a capture_packed_flex 240 python3 bench/capture_gpu.py --target "$T8" --data "$W/packed.jsonl" \
      --token-budget 49152 --attn flex_attention --batches 12
  stage a producer_dry_run_packed 200 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/packed.jsonl" \
      --producer-gpu $G0 --parts producer_alone --token-budget 49152 --limit 2500 --seconds 170
}

part1_drafter() {  # GPU1 (or GPU0 after the capture on one GPU)
  local d="python3 bench/drafter_step.py --gpu $G1 --block-size 16 --anchors 512 --seq-len 3072 --steps 10"
  stage b drafter_sdpa_4x3072 150 $d --seqs 4 --attn sdpa --skip-check
  stage b drafter_sdpa_8x3072 150 $d --seqs 8 --attn sdpa --skip-check
  stage b drafter_flex_4x3072 180 $d --seqs 4 --attn flex --skip-check
}

part2() {
  stage a pipeline 400 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/long.jsonl" --producer-gpu $G0 \
      --consumer-gpu $G1 --token-budget 12288 --seconds 150 &
  stage b transport 300 python3 bench/transport.py --sizes 16,64,256 --out "$OUT/transport_gpu_host.json"
  wait
}

part3() {
  stage c target06b 120 python3 bench/gpu_setup.py target --shape qwen3-0.6b --out "$T06"
  stage c tau 360 python3 bench/gpu_tau.py --target "$T06" --producer-gpu $G0 --consumer-gpu $G1 --epochs 10 \
      --train-timeout-s 150 --eval-rows 20 --max-new-tokens 64
}

part4() {  # the drafter step with fused elementwise kernels (--fuse on), both attention kernels
  local d="python3 bench/drafter_step.py --block-size 16 --anchors 512 --seq-len 3072 --steps 10 --skip-check --fuse on"
  (stage b drafter_flex_fuse_4x3072 200 $d --gpu $G1 --seqs 4 --attn flex
   stage b drafter_sdpa_fuse_4x3072 120 $d --gpu $G1 --seqs 4 --attn sdpa) &
  stage a drafter_flex_fuse_8x3072 200 $d --gpu $G0 --seqs 8 --attn flex
  wait
}

part5() {
  [ -f "$T8/config.json" ] && [ -f "$W/long.jsonl" ] || inputs
  stage e gpu_checks 120 python3 bench/gpu_checks.py --device cuda:$G0
  stage e pipeline_flex_fuse 330 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/long.jsonl" \
      --producer-gpu $G0 --consumer-gpu $G1 --token-budget 12288 --seconds 100 --attn flex --fuse on
  # Both roles on GPU 0. Each alone was just measured (on a GPU of its own, same model):
  # the bound is 1 / (1/P + 1/C) of those figures.
  stage e pipeline_shared_gpu 200 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/long.jsonl" \
      --producer-gpu $G0 --consumer-gpu $G0 --token-budget 12288 --seconds 100 --attn flex --fuse on --parts pipeline
}

part6() {  # three independent tracks at once: GPU1, GPU0, CPU
  (stage c target06b 120 python3 bench/gpu_setup.py target --shape qwen3-0.6b --out "$T06"
   stage c regen_speed 150 python3 bench/gpu_regen.py --target "$T06" --gpu $G1 --batches 1,16,64 --new-tokens 64
   stage c tau 400 python3 bench/gpu_tau.py --target "$T06" --producer-gpu $G1 --consumer-gpu $G1 --epochs 60 \
       --train-timeout-s 200 --eval-rows 20 --max-new-tokens 64 --eval-dtype float32) &
  local d="python3 bench/drafter_step.py --gpu $G0 --block-size 16 --anchors 512 --seq-len 3072 --steps 12 --skip-check --fuse on --vary"
  (stage d drafter_flex_fuse_vary 180 $d --seqs 4 --attn flex
   stage d drafter_sdpa_fuse_vary 150 $d --seqs 4 --attn sdpa) &
  stage g transport_io 420 python3 bench/transport.py --sizes 16,64,256 --repeat 2 --broker-io-threads 1,2 \
      --out "$OUT/transport_io_threads.json"
  wait
}

part7() {  # after 0be9099 (greedy loop) and the stager: three tracks at once (GPU1, GPU0, CPU)
  (stage c target06b 120 python3 bench/gpu_setup.py target --shape qwen3-0.6b --out "$T06"
   stage c regen_speed_loop 120 python3 bench/gpu_regen.py --target "$T06" --gpu $G1 --batches 16,64 --new-tokens 64
   stage c tau_fast_regen 420 python3 bench/gpu_tau.py --target "$T06" --producer-gpu $G1 --consumer-gpu $G1 \
       --epochs 200 --train-timeout-s 220 --eval-rows 20 --max-new-tokens 64 --eval-dtype float32) &
  ([ -f "$T8/config.json" ] && [ -f "$W/long.jsonl" ] || inputs
   stage f pipeline_shared_gpu_long 330 python3 bench/gpu_pipeline.py --target "$T8" --data "$W/long.jsonl" \
       --producer-gpu $G0 --consumer-gpu $G0 --token-budget 12288 --seconds 220 --attn flex --fuse on --parts pipeline) &
  stage g transport_small 300 python3 bench/transport.py --sizes 1,16 --repeat 2 --broker-io-threads 1,2 \
      --out "$OUT/transport_io_threads_small.json"
  wait
}

part8() {  # the transport before and after a change, on this host's cores (no GPU used)
  before h 300 --sizes 1,16 --repeat 3
  stage h transport_after 300 python3 bench/transport.py --sizes 1,16 --repeat 3 --out "$OUT/transport_after.json"
  stage h transport_after_fixed_credit 300 python3 bench/transport.py --sizes 1,16 --repeat 3 --inbox-bytes 0 \
      --out "$OUT/transport_after_fixed_credit.json"
  stage h transport_after_large 300 python3 bench/transport.py --sizes 64,256 --repeat 2 \
      --out "$OUT/transport_after_large.json"
}

part9() {
  stage i transport_fresh 300 python3 bench/transport.py --sizes 1,16 --repeat 3 --fresh-batches \
      --out "$OUT/transport_fresh.json"
  stage i transport_same 300 python3 bench/transport.py --sizes 1,16 --repeat 3 --out "$OUT/transport_same.json"
}

part10() {  # what sets the 16 MiB rate through the broker: one knob at a time; then --fresh-batches
  local t="python3 bench/transport.py --sizes 16 --repeat 2"
  stage j t16_default 200 $t --out "$OUT/t16_default.json"
  stage j t16_peer_io2 200 $t --io-threads 2 --out "$OUT/t16_peer_io2.json"
  stage j t16_malloc_reuse 200 $t --malloc-reuse --out "$OUT/t16_malloc_reuse.json"
  stage j t16_credit4 200 $t --credit 4 --out "$OUT/t16_credit4.json"
  stage j t16_broker_io3 200 $t --broker-io-threads 3 --out "$OUT/t16_broker_io3.json"
  stage j transport_fresh 300 python3 bench/transport.py --sizes 1,16 --repeat 2 --fresh-batches \
      --out "$OUT/transport_fresh.json"
}

part11() {  # the transport as it now stands (peers' links with 2 I/O threads, consumer malloc reuse)
  stage k transport_small 300 python3 bench/transport.py --sizes 1,16 --repeat 3 --out "$OUT/transport_small.json"
  stage k transport_large 300 python3 bench/transport.py --sizes 64,256 --repeat 2 --out "$OUT/transport_large.json"
}

part12() {  # does a small broker queue (its buffers recycled while still in cache) change 1/16 MiB?
  stage l transport_queue64 300 python3 bench/transport.py --sizes 1,16 --repeat 2 --queue-bytes 64MiB \
      --out "$OUT/transport_queue64.json"
  stage l transport_fresh 300 python3 bench/transport.py --sizes 1,16 --repeat 2 --fresh-batches \
      --out "$OUT/transport_fresh.json"
}

part13() {  # several producers and consumers through one broker on this host's cores
  stage m scaling_64 150 python3 bench/scaling.py --layouts 1x1,2x2,5x3 --mib 64 --gb 16 --out "$OUT/scaling_64.json"
  stage m scaling_16 100 python3 bench/scaling.py --layouts 2x2,5x3 --mib 16 --gb 16 --out "$OUT/scaling_16.json"
}

part14() {  # the relay's hot path and data streams: before and after on the same machine
  before n 240 --sizes 1,16 --repeat 3
  stage n transport_after 240 python3 bench/transport.py --sizes 1,16 --repeat 3 --out "$OUT/transport_after.json"
  stage n transport_after_1stream 240 python3 bench/transport.py --sizes 1,16 --repeat 3 \
      --broker-arg=--data-streams --broker-arg=1 --out "$OUT/transport_after_1stream.json"
  stage n transport_after_fresh 200 python3 bench/transport.py --sizes 1,16 --repeat 2 --fresh-batches \
      --out "$OUT/transport_after_fresh.json"
}

part15() {  # large batches, and several producers and consumers, as the code now stands
  stage o transport_large 240 python3 bench/transport.py --sizes 64,256 --repeat 2 --out "$OUT/transport_large.json"
  stage o scaling_64 150 python3 bench/scaling.py --layouts 1x1,2x2,5x3 --mib 64 --gb 16 --out "$OUT/scaling_64.json"
  stage o scaling_16 100 python3 bench/scaling.py --layouts 2x2,5x3 --mib 16 --gb 16 --out "$OUT/scaling_16.json"
}

part16() {  # the relay after session 5's second round, against BASELINE_TAR, longer runs
  local long=(--sizes 1,16 --gb 4 --max-messages 20000)
  # (the baseline's transport.py caps a size at 3,000 batches: 3 GB at 1 MiB, where this tree's moves 4)
  before p 200 --sizes 1,16 --gb 4 --repeat 4
  stage p transport_after 200 python3 bench/transport.py "${long[@]}" --repeat 4 --out "$OUT/transport_after.json"
  stage p transport_after_fresh 160 python3 bench/transport.py "${long[@]}" --repeat 3 --fresh-batches \
      --out "$OUT/transport_after_fresh.json"
  mkdir -p "$W/prof" && rm -f "$W/prof"/*.prof
  stage p transport_profiled 60 env DFLASH_BENCH_PROFILE="$W/prof" python3 bench/transport.py --sizes 1 --gb 2 \
      --modes broker --out "$OUT/transport_profiled.json"
  python3 bench/profile_top.py "$W/prof" --batches 2100 --top 12 > "$OUT/profile_top.txt" 2>&1
}

part17() {  # session 5's final state: small batches before/after, large batches, several peers
  local long=(--sizes 1,16 --gb 4 --max-messages 20000)
  before q 150 --sizes 1,16 --gb 4 --repeat 3
  stage q transport_after 180 python3 bench/transport.py "${long[@]}" --repeat 4 --out "$OUT/transport_after.json"
  stage q transport_large 150 python3 bench/transport.py --sizes 64,256 --repeat 2 --out "$OUT/transport_large.json"
  stage q scaling_64 100 python3 bench/scaling.py --layouts 5x3 --mib 64 --gb 16 --out "$OUT/scaling_64.json"
  stage q scaling_16 100 python3 bench/scaling.py --layouts 2x2,5x3 --mib 16 --gb 16 --out "$OUT/scaling_16.json"
}

part18() {  # producers' batches in on two connections as well
  local long=(--sizes 1,16 --gb 4 --max-messages 20000)
  stage r transport_after 180 python3 bench/transport.py "${long[@]}" --repeat 4 --out "$OUT/transport_after.json"
  stage r transport_after_fresh 120 python3 bench/transport.py "${long[@]}" --repeat 2 --fresh-batches \
      --out "$OUT/transport_after_fresh.json"
  stage r scaling_16 60 python3 bench/scaling.py --layouts 5x3 --mib 16 --gb 16 --out "$OUT/scaling_16.json"
}

case $PART in
  part1)
    if [ "$NGPU" -gt 1 ]; then (inputs; part1_capture) & part1_drafter; wait; else inputs; part1_capture; part1_drafter; fi ;;
  part2)
    [ -f "$T8/config.json" ] && [ -f "$W/long.jsonl" ] || inputs
    part2 ;;
  part3) part3 ;;
  part4) part4 ;;
  part34) part4; part3 ;;
  part5) part5 ;;
  part6) part6 ;;
  part7) part7 ;;
  part8) part8 ;;
  part9) part9 ;;
  part10) part10 ;;
  part11) part11 ;;
  part12) part12 ;;
  part13) part13 ;;
  part14) part14 ;;
  part15) part15 ;;
  part16) part16 ;;
  part17) part17 ;;
  part18) part18 ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
tar czf "$OUT/logs_$PART.tgz" -C "$W" logs $(cd "$W" && ls -d pipeline/*/*.out tau/*/*.out tau/*/*.json 2>/dev/null)
echo "done $PART in ${SECONDS}s"
