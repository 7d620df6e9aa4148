# Sourced by bench/gpu_quality.sh, bench/gpu_regen_step.sh and bench/gpu_one_gpu.sh, for a GPU machine that keeps
# /tmp only while warm: what both set up and the steps both take. The caller sets W (its
# work folder); this sets OUT (results, unless given), GGUF (the real target's path in W)
# and the environment (the carried wheels in /tmp/site first on the path).
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf

# The carried wheels into /tmp/site, and .carry/part-a of the GGUF target into $W.
gpu_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  cp .carry/part-a "$W/part-a" && ls -la "$W"
}

# The GGUF target joined from part-a (carried by gpu_install) and .carry/part-b, and this
# checkout installed over the machine's packages.
gpu_join() {
  [ -f "$GGUF" ] || cat "$W/part-a" .carry/part-b > "$GGUF" || return 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
}
