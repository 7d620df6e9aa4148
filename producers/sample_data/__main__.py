"""`python -m dflash.producers.sample_data` rewrites chats.jsonl from the generator."""

from . import write_chats

print(write_chats())
