"""dflash.runtime: what every process needs beside the wire. CLI config, structlog logs, run
folders and run.json, loading a target, GPU and memory figures, malloc and GC tuning,
graceful stop, thread names, transformers shims. It imports nothing of the wire (protocol/)
or of a role, so any folder may use it."""
