#!/usr/bin/env bash
# The real-target quality benchmark on a GPU machine that keeps /tmp only while it is warm
# and runs one command for at most 10 minutes: three calls in a row.
#
#   bash bench/gpu_quality.sh install       # wheels from .whl/ into /tmp/site; .carry/part-a to /tmp
#   bash bench/gpu_quality.sh start ARGS    # join .carry/part-b, build prompts, start
#                                           # bench/real_quality.py ARGS in the background and
#                                           # wait for it up to START_WAIT_S
#   bash bench/gpu_quality.sh wait          # wait for it (up to WAIT_S), copy results to $OUT
#
# The target is the GGUF file of SmolLM2-135M-Instruct, carried in two parts of under 50 MB
# (bench/real_target.py fetches it and writes the parts). A regeneration cache carried in
# .carry/regen/ is used as is, so a later run trains instead of regenerating.
set -uo pipefail
W=/tmp/dflash-quality
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:?usage: gpu_quality.sh install|start|wait}" in
install)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  cp .carry/part-a "$W/part-a" && ls -la "$W"
  python3 -c "import zmq, structlog, gguf, dflash.consumers.train; print('imports ok')"
  ;;
start)
  shift
  [ -f "$GGUF" ] || cat "$W/part-a" .carry/part-b > "$GGUF" || exit 1
  sha256sum "$GGUF"
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  [ -f "$W/prompts/train.jsonl" ] || python3 bench/real_prompts.py --tokenizer "$W" --gguf-file "$(basename "$GGUF")" \
      --out "$W/prompts" ${PROMPT_ARGS:-} || exit 1
  mkdir -p "$W/regen"
  for f in .carry/regen/*.xz.part-aa; do  # xz files split in parts of under 16 MiB
    [ -e "$f" ] || continue; name=$(basename "${f%.xz.part-aa}")
    [ -f "$W/regen/$name" ] || cat "${f%aa}"* | xz -dc > "$W/regen/$name" || exit 1
  done
  setsid nohup python3 bench/real_quality.py --target "$GGUF" --prompts "$W/prompts" --regen-cache "$W/regen" \
      --work "$W/runs" "$@" > "$W/quality.json" 2> "$W/quality.err" < /dev/null &
  pid=$!; echo "started $pid"; t0=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${START_WAIT_S:-540}" ]; do sleep 5; done
  tail -c 1500 "$W/quality.err"; ls "$W/runs"/*/ 2>/dev/null
  ;;
wait)
  t0=$SECONDS
  while pgrep -f bench/real_quality.py >/dev/null && [ $((SECONDS - t0)) -lt "${WAIT_S:-540}" ]; do sleep 5; done
  run=$(ls -d "$W"/runs/*/ | tail -1)
  cp "$W/quality.json" "$OUT/" 2>/dev/null
  tail -c 4000 "$W/quality.err" > "$OUT/quality.err"
  (cd "$run" && tar czf "$OUT/logs.tgz" --exclude='*.safetensors' broker.out producer.out consumer.out eval-*.json 2>/dev/null)
  [ -d "$run/export" ] && tar czf "$OUT/export.tgz" -C "$run" --exclude=model.safetensors export
  for f in "$W"/regen/*.sqlite; do [ -e "$f" ] && xz -T0 -6 -c "$f" | split -b 15M - "$OUT/$(basename "$f").xz.part-"; done
  ls -la "$OUT"; cat "$W/quality.json"
  ;;
esac
