"""Checkpoint folders: atomic save and resume, integrity (hashes, finite weights), the record of what was trained."""
