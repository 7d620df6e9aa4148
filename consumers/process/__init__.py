"""One `dflash-consume` process: its command, setup, joining the broker's run, the link as the loop's source and hooks."""
