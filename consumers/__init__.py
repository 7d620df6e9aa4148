"""Drafter consumers (`dflash-consume`, `dflash-export`): the DFlash drafter, its training loop,
checkpoints, evaluation and data-parallel ranks, one subpackage per concern.

Each imports only those above it (tests/test_imports.py holds the order):
  drafter/      the model, block layout, loss, fused kernels, MASK row
  checkpoints/  checkpoint folders, integrity, the record of what was trained
  parallel/     the data-parallel group, fixed or elastic
  training/     `Trainer` and its `step()`: process/ calls training.train.train(...)
  export/       `dflash-export` and the loader of published drafters
  evaluation/   speculative decoding, real tau, live evaluation, the dflash-eval core
  process/      one `dflash-consume` process: command, setup, the broker's run
"""
