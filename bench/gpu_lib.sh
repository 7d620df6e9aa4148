# Shared by bench/gpu_run.sh (the benchmarks of record) and bench/gpu_sessions.sh (the
# work sessions' parts behind bench/reports/): the environment, `stage`, the inputs and the
# before/after helper. Sourced, not run; the caller sets PART.
set -uo pipefail
OUT=${OUT:-/tmp/dflash-gpu/out}
W=${DFLASH_GPU_WORK:-/tmp/dflash-gpu}
mkdir -p "$OUT" "$W/logs"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
G0=0; G1=$(( NGPU > 1 ? 1 : 0 ))
T8=$W/qwen3-8b; T06=$W/qwen3-0.6b
echo "gpus=$NGPU $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"

# stage TRACK NAME TIMEOUT_S CMD...: run CMD, keep its log, copy its JSON lines (tagged) to
# the track's results file.
stage() {
  local track=$1 name=$2 limit=$3; shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$W/logs/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"
  python3 - "$W/logs/$name.log" "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/results_$track.jsonl" <<'EOF'
import json, sys
path, name, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print(json.dumps({"stage": name, "rc": rc, "seconds": secs}))
for line in open(path, errors="replace"):
    if line.startswith("{"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not ("event" in row and "ts" in row):  # the benchmark's rows, not log lines
            print(json.dumps({"stage": name, **row}))
EOF
  [ $rc -eq 0 ] || tail -5 "$W/logs/$name.log" | cut -c1-400
}

inputs() {
  stage setup target8b 240 python3 bench/gpu_setup.py target --shape qwen3-8b --out "$T8"
  stage setup data 120 bash -c "python3 bench/gpu_setup.py data --tokenizer '$T8' --out '$W/packed.jsonl' --n 3000 \
      && python3 bench/gpu_setup.py data --tokenizer '$T8' --out '$W/long.jsonl' --n 400 --median 100000 --min 3072"
}

# before TRACK LIMIT ARGS...: with BASELINE_TAR (a `git archive` of an earlier commit), run that
# commit's bench/transport.py ARGS into $OUT/transport_before.json on its own code, then put
# this tree back; without, nothing. Same machine, back to back: the before/after of a change.
before() {
  local track=$1 limit=$2; shift 2
  if [ -n "${BASELINE_TAR:-}" ]; then
    local base=/tmp/dflash-baseline
    rm -rf "$base" && mkdir -p "$base" && tar xf "$BASELINE_TAR" -C "$base"
    (cd "$base" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      && stage "$track" transport_before "$limit" python3 bench/transport.py "$@" --out "$OUT/transport_before.json")
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .  # this tree again
  fi
  python3 -c 'import dflash.broker as b; print("dflash from", b.__file__)'
}

