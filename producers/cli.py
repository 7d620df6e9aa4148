"""dflash-produce: run a frozen target and stream its hidden states to the broker.

    dflash-produce --gpu 0 --target Qwen/Qwen3-8B --data chats.jsonl --broker tcp://host:5555

`--dry-run` runs the same loop over the local dataset without a broker and throws the
batches away: a check of data, template, memory and throughput before a real run.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

import click

from dflash.protocol.curve import client_from, curve_options
from dflash.protocol.config import (as_dict, broker_option, command, config_option, default_instance, fail, option,
                                    runs_dir_option, target_option)
from dflash.protocol.errors import DFlashError
from dflash.protocol.logs import close_logging, get_logger, setup_logging

from .build import hello_config, load_components, make_producer
from .config import DEFAULT_REGEN_CACHE, ProducerConfig
from .producer import LocalWorkSource
from .target import resolve_device

log = get_logger()


@command("PRODUCE")
@config_option()
@broker_option()
@runs_dir_option()
@target_option("Target model: a local folder, a Hugging Face hub ID, or a .gguf file (de-quantised to --dtype by "
              "transformers; needs the gguf extra).")
@option("--data", required=True, help="Dataset: .jsonl (messages / conversations / text rows), "
        ".parquet, or a HF datasets folder (save_to_disk).")
@option("--gpu", type=int, default=None, help="GPU index to run the target on (default: GPU 0 if any, else CPU).")
@option("--device", default=None, help="Explicit torch device instead of --gpu, e.g. 'cpu' or 'cuda:1'.")
@option("--dtype", default="auto", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
        help="Model dtype; auto = bfloat16 on GPU, float32 on CPU. Hidden states travel in it.")
@option("--attn-impl", default="auto", help="Attention implementation (sdpa, eager, flash_attention_2, "
        "flex_attention); auto = flash_attention_2 on GPU when installed, else flex_attention; sdpa on CPU.")
@option("--target-layers", default=None, help="Comma-separated decoder layer IDs to capture (0-based, "
        "'layer i' = HF hidden_states[i+1]); default: 5 spaced from 1 to L-3, e.g. 1,9,17,25,33 for 36 layers.")
@option("--token-budget", type=int, default=16384, help="Max tokens per forward pass (packed, no padding); "
        "at least --max-length (lower both together, e.g. --token-budget 2048 --max-length 2048).")
@option("--max-batch-size", type=int, default=64, help="Max sequences per forward pass.")
@option("--max-length", type=int, default=3072, help="Sequences are truncated to this many tokens; at most "
        "--token-budget.")
@option("--lease-size", type=int, default=256, help="Samples asked of the broker per lease.")
@option("--prefetch", type=int, default=4, help="Batches prepared ahead of the GPU (the heartbeat's q_pre).")
@option("--skip-bad-rows", is_flag=True, default=False, help="Skip malformed rows (each logged, counted and "
        "reported to the broker) instead of stopping with an error naming file:line.")
@option("--regenerate", is_flag=True, default=False, help="Replace assistant turns by the target's own greedy "
        "generation before capture, trained as the exact token IDs generated (loss on those only); cached on disk "
        "per dataset, target and settings.")
@option("--max-new-tokens", type=int, default=1024, help="Generation length limit per turn with --regenerate.")
@option("--regen-batch-size", type=int, default=16, help="Rows generated together with --regenerate.")
@option("--regen-cache", default=DEFAULT_REGEN_CACHE, help="Folder of the regeneration cache (SQLite files).")
@option("--chat-template-kwargs", default="{}", help="JSON object passed to the chat template, "
        "e.g. '{\"enable_thinking\": false}'.")
@option("--hidden-encoding", default="raw", type=click.Choice(["raw", "fp8_e4m3_rowscale"]),
        help="Wire encoding of hidden states: raw (model dtype) or fp8 with per-row scales (half of bf16).")
@option("--final-hidden", is_flag=True, default=False, help="Also send each token's last hidden state after the "
        "final norm (the LM head's input, H values per token): consumers with --distill-weight compute the "
        "target's next-token distribution from it (docs/TRAINING.md \"Distillation\").")
@option("--check-packing/--no-check-packing", default=True, help="At start, verify that packed sequences "
        "do not attend to each other on this model (a few tiny forward passes).")
@option("--trust-remote-code", is_flag=True, default=False, help="Allow model code from the checkpoint.")
@option("--instance", default=None, help="This producer's name, unique among the run's live producers (default <host>-<device>-<pid>, "
        "e.g. node1-cuda0-4711).")
@option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]), help="Log level.")
@option("--dry-run", is_flag=True, default=False, help="No broker: one pass over the local dataset, batches "
        "discarded, summary printed.")
@option("--limit", type=int, default=None, help="With --dry-run: only the first N samples.")
@curve_options
def main(**kw) -> None:
    """Run a frozen target model on leased samples and stream hidden states to the broker."""
    cfg = ProducerConfig(**kw)
    try:
        cfg.check()
    except ValueError as e:
        fail(str(e))
    instance = cfg.instance or _default_instance(cfg)
    setup_logging("producer", instance, gpu=cfg.gpu, level=cfg.log_level)
    log.info("produce.start", config=as_dict(cfg))
    try:
        components = load_components(cfg)
        summary = _dry_run(cfg, components) if cfg.dry_run else _serve(cfg, components, instance)
    except (DFlashError, ValueError, FileNotFoundError, OSError) as e:
        log.error("produce.failed", error=f"{type(e).__name__}: {e}")
        close_logging()
        fail(str(e), code=1)
    except Exception as e:  # a bug or a library failure: still the run's log says why we died
        log.error("produce.failed", error=f"{type(e).__name__}: {str(e)[:2000]}", traceback=traceback.format_exc())
        close_logging()
        raise
    log.info("produce.done", **summary)
    close_logging()


def _default_instance(cfg: ProducerConfig) -> str:
    """`<host>-<device>-<pid>` (PROTOCOL.md 4.1)."""
    try:
        device = resolve_device(cfg.gpu, cfg.device)
    except ValueError as e:
        fail(str(e))
    return default_instance(f"cuda{device.index or 0}" if device.type == "cuda" else device.type)


def _dry_run(cfg: ProducerConfig, c) -> dict:
    n = len(c.dataset) if cfg.limit is None else min(cfg.limit, len(c.dataset))
    source = LocalWorkSource(n, cfg.lease_size)
    device = c.target.device
    if device.type == "cuda":  # the peak is the figure that sizes --token-budget
        import torch

        weights = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    summary = make_producer(cfg, c, source, lambda fields, tensors: None).run()
    if device.type == "cuda":
        summary["gpu_weights_gib"] = round(weights / 2**30, 2)
        summary["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    click.echo(" ".join(f"{k}={v}" for k, v in summary.items()), err=True)
    return summary


def _serve(cfg: ProducerConfig, c, instance: str) -> dict:
    """Connect to the broker, produce until it says there is no work left (or a signal
    says stop), leave."""
    from dflash.protocol.peer import PeerLink

    from .link import BrokerWorkSource, Stopped, link_sink

    producer = None
    link = PeerLink(cfg.broker, "producer", instance, gpu=cfg.gpu, config=hello_config(c, cfg),
                    curve=client_from(cfg.curve_keys, cfg.curve_name),
                    runs_dir=cfg.runs_dir, stats=lambda: producer.stats() if producer else {"state": "starting"})
    link.start()  # until we are welcome, a signal ends us at once: nothing is ours to hand back
    stop = threading.Event()
    previous = _stop_on_signals(stop)
    reason, flush_s = "failed", 60.0
    try:
        producer = make_producer(cfg, c, BrokerWorkSource(link, cfg.lease_size, stop), link_sink(link, stop))
        producer.stop = stop
        try:
            summary = producer.run()
        except Stopped:
            summary = producer.summary()
        reason = "done"
        if stop.is_set():
            # Leases not produced go back to the pool with our `bye` (PROTOCOL.md 6); a
            # batch still waiting for a full broker is not worth holding the exit for.
            reason, flush_s = f"signal {stop.signal_name}", 5.0
            log.warning("produce.stopped", signal=stop.signal_name, **summary)
        return summary
    finally:
        link.close(reason=reason, flush_timeout_s=flush_s)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_on_signals(stop: threading.Event) -> dict:
    """First SIGINT/SIGTERM: finish the batch in hand, say bye (the broker takes back our
    leases), exit 0. Second: die. The handler only sets a flag: it runs between two
    bytecodes of the main thread, which may hold the log's lock (PROTOCOL.md 4.6)."""
    stop.signal_name = None

    def handler(signum, _frame):
        if stop.is_set():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        stop.signal_name = signal.Signals(signum).name
        stop.set()

    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


if __name__ == "__main__":
    sys.exit(main())
