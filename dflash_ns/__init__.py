"""dflash-pipeline: online DFlash drafter training."""
