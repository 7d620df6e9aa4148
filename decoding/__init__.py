"""The greedy decoding core that `--regenerate` and evaluation (dflash-eval, live tau) run; imports no role."""
