"""The greedy decoding core that a producer's regeneration (`--regenerate`) and a consumer's
evaluation (dflash-eval, live tau) both run: shared ground, imported by roles, importing none."""
