#!/usr/bin/env bash
# The GPU part of the README's one-GPU path, in three calls of under 10 minutes each on a
# machine that keeps /tmp only while warm (bench/gpu_carry.sh sets it up):
#
#   bash bench/gpu_one_gpu.sh step     # carry .whl, .carry/part-a, .carry/baseline.tar: install;
#                                      # the drafter step before (the baseline tree) and after
#                                      # (or `install`: carry .whl, .carry/part-a; install only,
#                                      # a short first call when device time is short)
#   bash bench/gpu_one_gpu.sh start    # carry .carry/part-b: join the target, then
#                                      # bench/one_gpu_budget.py run (prompts + training under
#                                      # BUDGET seconds) in the background, waited on START_WAIT_S
#   bash bench/gpu_one_gpu.sh finish   # wait for the run, then bench/one_gpu_budget.py report
#                                      # (export, tau held-out and in-distribution, the logs'
#                                      # figures) and, time left, SWEEP configs on the run's own
#                                      # regenerated answers (bench/recipe_sweep.py)
#   bash bench/gpu_one_gpu.sh sweep    # after `install`; carry .carry/part-b (and .carry/sweep_data.tgz,
#                                      # a finish's $OUT/sweep_data.tgz, if kept; else the target writes
#                                      # COUNT prompts and answers them first): SWEEP configs, no run
#
# A run longer than a call (BUDGET over ~560 s, e.g. for the tau curve: CONSUMER_ARGS="--eval-every N
# --eval-prompts $W/run/prompts.holdout.jsonl"): `finish` says "the run goes on" until it has ended.
#
# Results land in $OUT: step_before.json, step_after.json, result.json, tau_curve.png/.json (with
# --eval-prompts), sweep.json, sweep.log, sweep_data.tgz (the run's regenerated answers and
# prompts, for a later `sweep`), logs.tgz.
# Environment: BUDGET (600), COUNT (prompts, 8000), HOLDOUT (8 per family), EPOCHS (20),
# PROMPT_ARGS / BROKER_ARGS / PRODUCER_ARGS / CONSUMER_ARGS (extra flags, one string each),
# STEP_ARGS (drafter-step flags), SWEEP (space-separated --config values; empty: no sweep),
# SWEEP_SAMPLES, SWEEP_DATA (sweep: the tgz, .carry/sweep_data.tgz), REGEN_ARGS (sweep:
# bench/regen_data.py flags), INDIST (16: training prompts the sweep measures), PROMPTS_FROM
# (prompts.jsonl with its .holdout.jsonl: none written), GPU (0; -1 runs it all on CPU:
# tests/tools/test_gpu_one_gpu_script.py), TARGET (default: the carried GGUF), BASELINE_TAR,
# W (work folder, ${TMPDIR:-/tmp}/dflash-onegpu).
set -uo pipefail
W=${W:-${TMPDIR:-/tmp}/dflash-onegpu}
. "$(dirname "$0")/gpu_carry.sh"  # OUT, GGUF, the environment
GPU=${GPU:-0}
TARGET=${TARGET:-$GGUF}
BASELINE_TAR=${BASELINE_TAR:-.carry/baseline.tar}  # `git archive` of the commit to compare against
export GPU TARGET W  # the background run (start) reads them too: unexported, its work folder was /run
# attention and fusion pinned: each tree's bench has its own defaults (older ones: sdpa)
STEP="bench/drafter_step.py --shape smollm2-135m --seqs 16 --seq-len 290 --vary --steps 30 --attn flex --fuse on ${STEP_ARGS:-}"

budget_run() {  # the run, as one_gpu_budget.py's arguments
  local a=(--target "$TARGET" --work "$W/run" --gpu "$GPU" --budget "${BUDGET:-600}" --count "${COUNT:-8000}"
           --holdout "${HOLDOUT:-8}" --epochs "${EPOCHS:-20}" --producer-arg "--regen-cache $W/regen ${PRODUCER_ARGS:-}")
  [ -n "${PROMPT_ARGS:-}" ] && a+=(--prompt-arg "$PROMPT_ARGS")
  [ -n "${PROMPTS_FROM:-}" ] && a+=(--prompts-from "$PROMPTS_FROM")
  [ -n "${BROKER_ARGS:-}" ] && a+=(--broker-arg "$BROKER_ARGS")
  [ -n "${CONSUMER_ARGS:-}" ] && a+=(--consumer-arg "$CONSUMER_ARGS")
  python3 bench/one_gpu_budget.py run "${a[@]}"
}

pack_sweep_data() {  # PROMPTS HOLDOUT REGEN_DIR -> $W/sweep_data and $OUT/sweep_data.tgz (train, indist, heldout, answers)
  rm -rf "$W/sweep_data"; mkdir -p "$W/sweep_data"
  cp "$1" "$W/sweep_data/train.jsonl"; head -n "${INDIST:-16}" "$1" > "$W/sweep_data/indist.jsonl"; cp "$2" "$W/sweep_data/heldout.jsonl"
  # one file (the WAL folded in) without the chats' text, which the sweep does not read: it travels
  python3 - "$(ls -S "$3"/*.sqlite | head -1)" "$W/sweep_data/regen.sqlite" <<'EOF' || return 1
import sqlite3, sys
sqlite3.connect(sys.argv[1]).execute("VACUUM INTO ?", (sys.argv[2],))
out = sqlite3.connect(sys.argv[2], isolation_level=None)
out.execute("UPDATE regen_ids SET messages = '[]'")
out.execute("VACUUM")
EOF
  tar czf "$OUT/sweep_data.tgz" -C "$W" sweep_data
}

run_sweep() {  # CACHE PROMPTS_DIR: the SWEEP configs on those answers, each row in $OUT as it ends
  local cfg=() dev=cuda; for c in $SWEEP; do cfg+=(--config "$c"); done
  [ "$GPU" -lt 0 ] && dev=cpu
  python3 bench/recipe_sweep.py --target "$TARGET" --regen "$1" --prompts "$2" \
      --samples "${SWEEP_SAMPLES:-20000}" --device "$dev" ${SWEEP_ARGS:-} "${cfg[@]}" --out "$OUT/sweep.json" \
      2>&1 | tee "$OUT/sweep.log" | grep -v '"level": "info"' | tail -30
}

case "${1:?usage: gpu_one_gpu.sh install|step|start|finish|sweep}" in
install)
  [ "$GPU" -lt 0 ] && exit 0  # CPU: nothing to carry in
  gpu_install && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  ;;
step)
  if [ "$GPU" -ge 0 ]; then
    gpu_install || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  else  # CPU: no drafter step to time; each tree must still import its own code
    STEP="-c 'import dflash.consumers.training.train as t, json; print(json.dumps({\"train\": t.__file__}))'"
  fi
  if [ -f "$BASELINE_TAR" ]; then  # the tree before, built into its own site folder
    rm -rf "$W/base" "$W/base_site"; mkdir -p "$W/base" && tar xf "$BASELINE_TAR" -C "$W/base" || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$W/base_site" "$W/base" || exit 1
    (cd "$W/base" && PYTHONPATH="$W/base_site:$PYTHONPATH" eval python3 "$STEP") | tee "$OUT/step_before.json"
  fi
  eval python3 "$STEP" | tee "$OUT/step_after.json"
  ;;
start)
  [ "$GPU" -lt 0 ] || gpu_join || exit 1
  [ "$GPU" -lt 0 ] || sha256sum "$GGUF"
  rm -rf "$W/run"
  setsid nohup bash -c "$(declare -f budget_run); budget_run" > "$W/run.log" 2>&1 < /dev/null &
  pid=$!; echo "$pid" > "$W/run.pid"; echo "started $pid"; t0=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${START_WAIT_S:-560}" ]; do sleep 5; done
  tail -c 1500 "$W/run.log"
  ;;
finish)
  t0=$SECONDS
  while [ -f "$W/run.pid" ] && kill -0 "$(cat "$W/run.pid")" 2>/dev/null && [ $((SECONDS - t0)) -lt "${WAIT_S:-300}" ]; do
    sleep 5
  done
  if [ -f "$W/run.pid" ] && kill -0 "$(cat "$W/run.pid")" 2>/dev/null; then  # a run longer than a call: finish again
    echo "the run goes on after ${WAIT_S:-300} s:"; tail -c 1500 "$W/run.log"; exit 0
  fi
  [ -f "$W/run/run.json" ] || { echo "the run left no run.json:"; tail -c 3000 "$W/run.log"; exit 1; }
  python3 bench/one_gpu_budget.py report --target "$TARGET" --work "$W/run" --gpu "$GPU" \
      ${REPORT_ARGS:-} > "$OUT/result.json" 2> "$W/report.err" || { tail -c 3000 "$W/report.err"; exit 1; }
  (cd "$W/run" && tar czf "$OUT/logs.tgz" $(ls broker.out producer.out consumer.out prompts.out eval-*.json run.json 2>/dev/null))
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({k: r.get(k) for k in ('checks','heldout','indist')})[:3000])" "$OUT/result.json"
  if cat "$W"/run/runs/latest/logs/consumer-*.jsonl 2>/dev/null | grep -q '"event": "eval.tau"'; then
    # the run's live evaluation (CONSUMER_ARGS --eval-every N --eval-prompts ...): tau against samples
    python3 bench/tau_curve.py --run "$W/run/runs/latest" --out "$OUT/tau_curve.png" --json "$OUT/tau_curve.json" \
        > "$W/curve.log" 2>&1 || { tail -c 2000 "$W/curve.log"; exit 1; }
  fi
  # the answers and prompts, for a `sweep` call of a later session (no regeneration there)
  pack_sweep_data "$W/run/prompts.jsonl" "$W/run/prompts.holdout.jsonl" "$W/regen" || exit 1
  if [ -n "${SWEEP:-}" ]; then  # the same answers, other recipes: held-out tau decides (bench/recipe_sweep.py)
    run_sweep "$W/sweep_data/regen.sqlite" "$W/sweep_data"
  fi
  ;;
sweep)
  [ "$GPU" -lt 0 ] || gpu_join || exit 1
  rm -rf "$W/sweep_data"
  if [ -f "${SWEEP_DATA:-.carry/sweep_data.tgz}" ]; then
    tar xzf "${SWEEP_DATA:-.carry/sweep_data.tgz}" -C "$W" || exit 1
  else  # none carried: the target writes the prompts (or PROMPTS_FROM) and answers them as a run's producer would
    mkdir -p "$W/sweep_prompts"; rm -rf "$W/sweep_regen"
    if [ -n "${PROMPTS_FROM:-}" ]; then
      cp "$PROMPTS_FROM" "$W/sweep_prompts/prompts.jsonl"; cp "${PROMPTS_FROM%.jsonl}.holdout.jsonl" "$W/sweep_prompts/prompts.holdout.jsonl"
    else
      python3 -m dflash.tools.self_prompts --target "$TARGET" --count "${COUNT:-8000}" --holdout "${HOLDOUT:-8}" --out "$W/sweep_prompts/prompts.jsonl" \
          $([ "$GPU" -ge 0 ] && echo --gpu "$GPU") ${PROMPT_ARGS:-} > "$OUT/prompts.log" 2>&1 || { tail -c 2000 "$OUT/prompts.log"; exit 1; }
    fi
    python3 bench/regen_data.py --target "$TARGET" --data "$W/sweep_prompts/prompts.jsonl" --regen-cache "$W/sweep_regen" \
        $([ "$GPU" -ge 0 ] && echo --gpu "$GPU") ${REGEN_ARGS:-} 2> "$OUT/regen.log" | tee "$OUT/regen.json" \
        || { tail -c 2000 "$OUT/regen.log"; exit 1; }
    pack_sweep_data "$W/sweep_prompts/prompts.jsonl" "$W/sweep_prompts/prompts.holdout.jsonl" "$W/sweep_regen" || exit 1
  fi
  run_sweep "$W/sweep_data/regen.sqlite" "$W/sweep_data"
  ;;
esac
