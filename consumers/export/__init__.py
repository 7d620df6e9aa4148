"""`dflash-export`: a checkpoint in the published DFlash layout, its model card and transformers model code."""
