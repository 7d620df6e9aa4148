"""`ConsumerConfig`, the dflash-consume process around the training loop (broker, ranks,
evaluation, sinks): each field the option of its name, declared once, here
(training/config.py holds the training loop's). consume_command.py makes the command from
both; torch-free, so that `--help` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from dflash.consumers.training.config import TrainConfig
from dflash.runtime.command_line import (broker_setting, curve_keys_setting, curve_name_setting, log_level_setting,
                                         parse_bytes, runs_dir_setting, setting, target_setting)


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """The consumer process's settings; each field is the dflash-consume option of its name
    (`train` gives TrainConfig's in its place), in --help order but for what consume_command
    places otherwise (--device, --inbox-bytes)."""

    target: str = target_setting("Target model folder (Hugging Face layout), hub ID or .gguf file; only config, "
                                 "tokenizer, embed_tokens and lm_head are read.", need_tokenizer=False)
    gpu: int | None = setting(None, help="CUDA device index; omitted: train on CPU (float32).")
    broker: str = broker_setting()
    runs_dir: str = runs_dir_setting()
    instance: str | None = setting(  # consume_command fills in the default
        None, help="This consumer's name in logs and at the broker, unique among the run's live consumers (default "
        "<host>-<device>-<pid>, e.g. node1-cuda2-4711).")
    run_id: str | None = setting(
        None, help="Local run: its ID (default: a new one). With a broker: join only if it serves this run (default: "
        "the broker's run).")
    train: TrainConfig
    inbox_bytes: int = setting(  # received batches waiting, in bytes (protocol/credit.py)
        "256MiB", parse=parse_bytes,
        help="Most bytes of received batches waiting in this consumer: always room for 2 batches, and for up to "
             "16 while they are small, so the round trip to the broker does not set the rate.")
    dist_init: str | None = setting(  # tcp://HOST:PORT rendezvous of the data-parallel group
        None, help="tcp://HOST:PORT rendezvous for data-parallel ranks you arrange yourself (torchrun's env also "
        "works); default: the ranks the broker arranges (dflash-broker --consumers N).")
    dist_addr: str | None = setting(  # HOST:PORT offered to the broker's other ranks if we are rank 0
        None, help="HOST:PORT this consumer offers the broker's other ranks to meet at if it becomes rank 0 "
        "(default: this host's IP towards the broker and a free port).")
    rank: int = setting(0, type=click.IntRange(0), help="This consumer's rank with --dist-init.")
    world_size: int = setting(1, type=click.IntRange(1), help="Number of consumer ranks with --dist-init.")
    synthetic_batches: int = setting(
        0, type=click.IntRange(0), help="Train on N local synthetic batches instead of a broker.")
    synthetic_seqs: int = setting(4, type=click.IntRange(1), help="Sequences per synthetic batch.")
    synthetic_seq_len: int = setting(512, type=click.IntRange(2), help="Tokens per synthetic sequence.")
    eval_every: int = setting(  # live evaluation on rank 0 (live_eval.py), 0 = off
        0, type=click.IntRange(0),
        help="Every N steps rank 0 evaluates the drafter before the next step trains: simulated acceptance on "
        "that step's batch (not trained yet), and real tau with --eval-prompts; logged as eval.*, shown by "
        "dflash-status (docs/EVAL.md). 0: off.")
    eval_prompts: str | None = setting(  # loads the whole target
        None, type=click.Path(exists=True, dir_okay=False),
        help="JSON Lines prompts (as dflash-eval reads them) for real tau during training; rank 0 then loads "
        "the whole --target on its device. Needs --eval-every.")
    eval_max_new_tokens: int = setting(64, type=click.IntRange(1), help="Tokens decoded per eval prompt.")
    eval_limit: int | None = setting(8, type=click.IntRange(1), help="Use only the first N of --eval-prompts.")
    tensorboard: str | None = setting(  # rank 0; runtime/sinks.py
        None, metavar="DIR", type=click.Path(file_okay=False),
        help="Also write rank 0's train.step figures as TensorBoard scalars under DIR/<run_id>, named as the JSON "
        "fields (train.step/loss, train.step/tokens_per_s); needs the tensorboard extra.")
    wandb: str | None = setting(  # rank 0; WANDB_MODE=offline: files only
        None, metavar="PROJECT",
        help="Also log rank 0's train.step figures to Weights & Biases PROJECT (same names as --tensorboard; run "
        "<run_id>-consumer, files in the run folder); WANDB_MODE=offline writes them locally only. Needs the wandb "
        "extra.")
    log_level: str = log_level_setting()
    curve_keys: str | None = curve_keys_setting()  # None = plain TCP
    curve_name: str | None = curve_name_setting()
