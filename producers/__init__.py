"""dflash.producers: frozen target models that turn leased samples into hidden-state batches.

In data-flow order: data, chat, regenerate, packing, prefetch, target, capture_oom, producer,
broker_work, build; produce_command (dflash-produce) -> producer_process. sample_data: demo chats."""
