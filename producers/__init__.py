"""dflash.producers: frozen target models that turn leased samples into hidden-state batches.

Modules, in data-flow order: `data` (datasets by sample ID), `chat` (template + loss mask),
`regenerate` (--regenerate), `packing` (varlen batches), `prefetch` (the CPU side, ahead
of the GPU), `target` (load + layer capture), `capture_oom` (split and retry), `producer`
(the loop), `broker_work` (the broker plugs), `build` (assembly from
`producer_config.ProducerConfig`);
`produce_command` (dflash-produce: options -> ProducerConfig) -> `producer_process` (one
producer process). `sample_data` holds the bundled demo chats.
"""
