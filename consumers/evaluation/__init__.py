"""Measuring a drafter: speculative decoding against the target, live evaluation during training, the dflash-eval core."""
