"""dflash.runtime: what every process needs beside the wire (CLI config, logs, run folders, target
loading, GPU and memory figures, stop). It imports nothing of protocol/ or a role."""
