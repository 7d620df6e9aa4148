# Sourced by bench/gpu_quality.sh and bench/gpu_regen_step.sh, for a GPU machine that keeps /tmp only while warm:
# the steps both take. Needs W (the work folder) and GGUF (the target's path in it).

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
