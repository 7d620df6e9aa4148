#!/usr/bin/env bash
# The real-target quality benchmark on a GPU machine that keeps /tmp only while it is warm
# and runs one command for at most 10 minutes: three calls in a row.
#
#   bash bench/gpu_quality.sh install       # wheels from .whl/ into /tmp/site; .carry/part-a to /tmp
#   bash bench/gpu_quality.sh prepare       # join .carry/part-b, have the target write SELF_PROMPTS
#                                           # prompts (dflash-prompts; 0: none), build prompts
#                                           # (PROMPT_ARGS) with them mixed in, and regenerate them
#                                           # into the producer's cache (bench/regen_data.py, for up
#                                           # to REGEN_S seconds)
#   bash bench/gpu_quality.sh start ARGS    # join .carry/part-b, build prompts, start
#                                           # bench/real_quality.py ARGS in the background and
#                                           # wait for it up to START_WAIT_S
#   bash bench/gpu_quality.sh wait          # wait for it (up to WAIT_S), copy results to $OUT
#   bash bench/gpu_quality.sh sweep ARGS    # instead of start: bench/recipe_sweep.py ARGS on the
#                                           # carried regeneration cache, in the background;
#                                           # `wait` collects it the same way
#
# The target is the GGUF file of SmolLM2-135M-Instruct, carried in two parts of under 50 MB
# (bench/real_target.py fetches it and writes the parts). A regeneration cache carried in
# .carry/regen/ (xz, split) is put under the key this run's producer computes
# (bench/seed_regen_cache.py), so a later run trains instead of regenerating; .carry/prompts/
# (train.jsonl, indist.jsonl, heldout.jsonl) replaces the prompts bench/real_prompts.py builds.
set -uo pipefail
W=/tmp/dflash-quality
. "$(dirname "$0")/gpu_carry.sh"  # OUT, GGUF, the environment

case "${1:?usage: gpu_quality.sh install|prepare|start|sweep|wait}" in
install)
  gpu_install || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  python3 -c "import zmq, structlog, gguf, dflash.consumers.training.train; print('imports ok')"
  ;;
prepare)
  gpu_join || exit 1
  self=()
  if [ "${SELF_PROMPTS:-0}" -gt 0 ]; then
    [ -f "$W/self.jsonl" ] || python3 -m dflash.tools.self_prompts --target "$GGUF" --count "$SELF_PROMPTS" \
        --out "$W/self.jsonl" --gpu 0 2> "$W/self.err" | tee "$OUT/self_prompts.json" || { tail -5 "$W/self.err"; exit 1; }
    head -c 2000 "$W/self.jsonl"; cp "$W/self.jsonl" "$OUT/"; self=(--self-prompts "$W/self.jsonl")
  fi
  [ -f "$W/prompts/train.jsonl" ] || python3 bench/real_prompts.py --tokenizer "$W" --gguf-file "$(basename "$GGUF")" \
      --out "$W/prompts" "${self[@]}" ${PROMPT_ARGS:-} || exit 1
  python3 bench/regen_data.py --target "$GGUF" --data "$W/prompts/train.jsonl" --regen-cache "$W/regen" \
      --max-new-tokens "${SEED_MAX_NEW_TOKENS:-256}" --gpu 0 --chunk 4000 --budget-s "${REGEN_S:-240}" \
      2> "$W/regen.err" | tee "$OUT/regen.json"; tail -2 "$W/regen.err"
  ;;
start)
  shift
  gpu_join || exit 1
  sha256sum "$GGUF"
  [ -d .carry/prompts ] && [ ! -d "$W/prompts" ] && cp -r .carry/prompts "$W/prompts"
  [ -f "$W/prompts/train.jsonl" ] || python3 bench/real_prompts.py --tokenizer "$W" --gguf-file "$(basename "$GGUF")" \
      --out "$W/prompts" ${PROMPT_ARGS:-} || exit 1
  mkdir -p "$W/regen" "$W/carried"
  for f in .carry/regen/*.xz.part-aa; do  # xz files split in parts of under 16 MiB
    [ -e "$f" ] || continue; name=$(basename "${f%.xz.part-aa}")
    [ -f "$W/carried/$name" ] || cat "${f%aa}"* | xz -dc > "$W/carried/$name" || exit 1
    # under the key this producer will compute (another machine's key may differ in form only)
    python3 bench/seed_regen_cache.py --from "$W/carried/$name" --target "$GGUF" --data "$W/prompts/train.jsonl" \
        --regen-cache "$W/regen" --max-new-tokens "${SEED_MAX_NEW_TOKENS:-256}" --gpu 0 2>&1 | tail -1 || exit 1
  done
  setsid nohup python3 bench/real_quality.py --target "$GGUF" --prompts "$W/prompts" --regen-cache "$W/regen" \
      --work "$W/runs" "$@" > "$W/quality.json" 2> "$W/quality.err" < /dev/null &
  pid=$!; echo "started $pid"; t0=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${START_WAIT_S:-540}" ]; do sleep 5; done
  tail -c 1500 "$W/quality.err"; ls "$W/runs"/*/ 2>/dev/null
  ;;
sweep)
  shift
  gpu_join || exit 1
  cache=$(ls .carry/regen/*.xz.part-aa | head -1); name=$(basename "${cache%.xz.part-aa}")
  [ -f "$W/regen/$name" ] || { mkdir -p "$W/regen"; cat "${cache%aa}"* | xz -dc > "$W/regen/$name"; } || exit 1
  setsid nohup python3 bench/recipe_sweep.py --target "$GGUF" --regen "$W/regen/$name" --prompts .carry/prompts \
      --out "$W/sweep.json" "$@" > "$W/sweep.log" 2>&1 < /dev/null &
  pid=$!; echo "started $pid"; t0=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${START_WAIT_S:-540}" ]; do sleep 5; done
  cp "$W/sweep.json" "$W/sweep.log" "$OUT/" 2>/dev/null; grep -v '^\s*$' "$W/sweep.log" | grep -v 'info  \|warning' | tail -40
  ;;
wait)
  t0=$SECONDS
  if pgrep -f bench/recipe_sweep.py >/dev/null || [ -f "$W/sweep.log" ] && [ ! -d "$W/runs" ]; then
    while pgrep -f bench/recipe_sweep.py >/dev/null && [ $((SECONDS - t0)) -lt "${WAIT_S:-540}" ]; do sleep 5; done
    cp "$W/sweep.json" "$W/sweep.log" "$OUT/" 2>/dev/null; tail -40 "$W/sweep.log"; exit 0
  fi
  while pgrep -f bench/real_quality.py >/dev/null && [ $((SECONDS - t0)) -lt "${WAIT_S:-540}" ]; do sleep 5; done
  run=$(ls -d "$W"/runs/*/ | tail -1)
  cp "$W/quality.json" "$OUT/" 2>/dev/null
  tail -c 4000 "$W/quality.err" > "$OUT/quality.err"
  (cd "$run" && tar czf "$OUT/logs.tgz" --exclude='*.safetensors' broker.out producer.out consumer.out eval-*.json 2>/dev/null)
  [ -d "$run/export" ] && tar czf "$OUT/export.tgz" -C "$run" --exclude=model.safetensors export
  [ -f "$run/export/model.safetensors" ] && split -b 15M "$run/export/model.safetensors" "$OUT/model.safetensors.part-"
  [ -n "${KEEP_REGEN:-}" ] && for f in "$W"/regen/*.sqlite; do [ -e "$f" ] && xz -T0 -6 -c "$f" | split -b 15M - "$OUT/$(basename "$f").xz.part-"; done
  ls -la "$OUT"; cat "$W/quality.json"
  ;;
esac
