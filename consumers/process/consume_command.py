"""dflash-consume's command line: the options, made into the frozen `ConsumerConfig` (with
its `TrainConfig`), then handed to consumer_process.run. torch is imported only once the
options are read (the process and what it imports need it), so that `--help` answers at once.

    python -m dflash.consumers.process.consume_command --target Qwen/Qwen3-8B --broker tcp://host:5555
"""

from __future__ import annotations

import click

from dflash.runtime.command_line import (broker_option, command, config_option, curve_options, default_instance, fail,
                                    log_level_option, option, runs_dir_option, size_option, target_option)


def _layers(_ctx, _param, value: str | None) -> tuple[int, ...] | None:
    if value in (None, "", "auto"):
        return None
    try:
        return tuple(int(x) for x in value.replace(" ", "").split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of layer IDs") from None


@command("CONSUME", max_content_width=100)
@config_option()
@target_option("Target model folder (Hugging Face layout), hub ID or .gguf file; only config, tokenizer, "
               "embed_tokens and lm_head are read.", need_tokenizer=False)
@option("--gpu", type=int, default=None, help="CUDA device index; omitted: train on CPU (float32).")
@option("--device", default=None, help="Torch device instead of --gpu, as dflash-produce takes it: 'cpu', 'cuda' "
        "or 'cuda:N'.")
@broker_option()
@runs_dir_option()
@option("--instance", default=None, help="This consumer's name in logs and at the broker, unique among the run's live consumers (default "
        "<host>-<device>-<pid>, e.g. node1-cuda2-4711).")
@option("--run-id", default=None, help="Local run: its ID (default: a new one). With a broker: join only if it "
        "serves this run (default: the broker's run).")
@option("--draft-layers", default=5, type=click.IntRange(1), help="Draft decoder layers (paper: 5).")
@option("--target-layers", default="auto", callback=_layers,
        help="Comma-separated 0-based target layer IDs fed to the drafter; auto: the broker run's (its "
        "producers'), else 5 spaced from 1 to L-3.")
@option("--block-size", default=16, type=click.IntRange(2), help="Block size B: anchor + B-1 drafted tokens.")
@option("--anchors", default=512, type=click.IntRange(1), help="At most this many anchors per sequence.")
@option("--anchor-every", default=1, type=click.IntRange(1),
        help="One anchor per this many trainable positions of a sequence (1: every one, up to --anchors).")
@option("--gamma", default=None, type=float, help="--loss ce decay exp(-(k-1)/gamma); default 7/5/4 for B=16/10/8, else 1+3B/8.")
@option("--mask-token-id", default=None, type=int,
        help="Vocabulary row used as MASK; default: chosen for the target (its mask token, else the first row past "
        "the tokenizer, else a reserved or unused special token: docs/TRAINING.md), never pad/eos/bos/unk.")
@option("--distill-weight", default=0.0, type=click.FloatRange(0, 1),
        help="Knowledge distillation: loss = (1 - a) x CE(labels) + a x KL(target || drafter), the target's "
        "next-token distribution from its final hidden state (producers need --final-hidden); 0: hard labels only.")
@option("--loss", default="ce", type=click.Choice(["ce", "dpace"]),
        help="ce: cross-entropy with block position k weighted exp(-(k-1)/gamma) (the DFlash paper); dpace: "
        "D-PACE (arXiv 2605.18810), weights from the drafter's own confidence in each label, the credit each "
        "position has in the expected accepted length (docs/TRAINING.md).")
@option("--dpace-alpha", default=None, type=click.FloatRange(0, 1, min_open=True),
        help="D-PACE's smoothing a in (0, 1]: each confidence q counts as (1 - a) q + a; default 0.5. "
        "Only with --loss dpace.")
@option("--lr", default=6e-4, type=float, help="Peak AdamW learning rate.")
@option("--min-lr", default=0.0, type=float, help="Learning rate at the end of the cosine schedule.")
@option("--warmup", default=0.04, type=click.FloatRange(0, 1), help="Warmup as a fraction of the planned samples (or of --total-steps).")
@option("--total-samples", default=None, type=click.IntRange(1),
        help="Samples the lr/noise schedules run over (warmup, then cosine to --min-lr at the last one); default: "
        "the broker's epochs x samples (less skipped ones), else a resumed checkpoint's plan, else the local "
        "stream's size; none known: constant lr, with a warning (docs/TRAINING.md).")
@option("--total-steps", default=None, type=click.IntRange(1),
        help="Schedule by optimizer steps instead of samples: the lr/noise schedules' length in steps.")
@option("--max-steps", default=None, type=click.IntRange(0), help="Stop after this many steps (default: end of stream).")
@option("--grad-clip", default=1.0, type=float, help="Clip the global gradient norm to this value.")
@option("--weight-decay", default=0.0, type=float, help="AdamW weight decay.")
@option("--feature-scaling/--no-feature-scaling", default=True,
        help="Standardise each target feature column before the drafter's fc, by factors set from the first "
        "batch (a pretrained target's few huge residual columns otherwise drown the context); the export folds "
        "them into fc.weight (docs/TRAINING.md).")
@option("--feature-noise", default=0.0, type=click.FloatRange(0), help="Gaussian noise on target features, relative to each layer's RMS.")
@option("--noise-schedule", default="linear", type=click.Choice(["constant", "linear", "cosine"]),
        help="How --feature-noise decays to 0 over the planned samples (or --total-steps).")
@option("--seed", default=0, type=int, help="Seed for initialisation, anchors and noise.")
@option("--loss-chunk", default=2048, type=click.IntRange(1), help="Block positions per logits chunk (memory vs speed).")
@option("--attn", default="auto", type=click.Choice(["auto", "sdpa", "flex"]),
        help="Attention kernel; auto: flex on GPU (sdpa if no C compiler can build it), sdpa on CPU. flex: "
             "block-sparse attention over the blocks, compiled on the first step (faster steps, slower start); "
             "sdpa: one masked call per sequence.")
@option("--fuse", default="auto", type=click.Choice(["auto", "on", "off"]),
        help="Fuse the step's elementwise work (RMSNorm, RoPE, SwiGLU, the loss's softmax) with torch.compile: "
             "faster steps, slower start; auto: on on GPU (off if no C compiler can build the kernels).")
@option("--inbox-bytes", default="256MiB", callback=size_option,
        help="Most bytes of received batches waiting in this consumer: always room for 2 batches, and for up to "
             "16 while they are small, so the round trip to the broker does not set the rate.")
@option("--stage-batches/--no-stage-batches", default=True,
        help="Prepare the next batch on a thread while the step runs: on GPU it is copied straight from the "
             "received message to the GPU (fp8 as fp8, dequantised there) on a stream of its own, off the step's "
             "critical path; it holds one batch more in GPU memory. --no-stage-batches prepares each batch "
             "between steps, on the CPU: for a step that barely fits in GPU memory.")
@option("--precision", default="auto", type=click.Choice(["auto", "bf16", "fp32"]), help="auto: bf16 autocast on GPU, fp32 on CPU.")
@option("--save-every", default=1000, type=click.IntRange(0), help="Checkpoint every N steps (0: only at the end).")
@option("--keep", default=3, type=click.IntRange(1), help="Checkpoints to keep in this run.")
@option("--resume", default=None,
        help="Checkpoint folder, run ID or run folder, or 'latest', to continue from. In a broker run none is needed "
             "(the broker names the checkpoint); 'latest' where no checkpoint exists yet starts as without --resume.")
@option("--force", is_flag=True, default=False, help="Resume even if the training signal differs from the checkpoint's.")
@option("--log-position-every", default=100, type=click.IntRange(0), help="Log per-position accuracy every N steps.")
@option("--epoch-samples", default=None, type=click.IntRange(1),
        help="Samples per epoch, for the logged epoch fraction of a local run (with a broker: the broker's count).")
@option("--dist-init", default=None, help="tcp://HOST:PORT rendezvous for data-parallel ranks you arrange yourself "
        "(torchrun's env also works); default: the ranks the broker arranges (dflash-broker --consumers N).")
@option("--dist-addr", default=None, help="HOST:PORT this consumer offers the broker's other ranks to meet at if it "
        "becomes rank 0 (default: this host's IP towards the broker and a free port).")
@option("--rank", default=0, type=click.IntRange(0), help="This consumer's rank with --dist-init.")
@option("--world-size", default=1, type=click.IntRange(1), help="Number of consumer ranks with --dist-init.")
@option("--synthetic-batches", default=0, type=click.IntRange(0), help="Train on N local synthetic batches instead of a broker.")
@option("--synthetic-seqs", default=4, type=click.IntRange(1), help="Sequences per synthetic batch.")
@option("--synthetic-seq-len", default=512, type=click.IntRange(2), help="Tokens per synthetic sequence.")
@option("--eval-every", default=0, type=click.IntRange(0),
        help="Every N steps rank 0 evaluates the drafter before the next step trains: simulated acceptance on "
        "that step's batch (not trained yet), and real tau with --eval-prompts; logged as eval.*, shown by "
        "dflash-status (docs/EVAL.md). 0: off.")
@option("--eval-prompts", default=None, type=click.Path(exists=True, dir_okay=False),
        help="JSON Lines prompts (as dflash-eval reads them) for real tau during training; rank 0 then loads "
        "the whole --target on its device. Needs --eval-every.")
@option("--eval-max-new-tokens", default=64, type=click.IntRange(1), help="Tokens decoded per eval prompt.")
@option("--eval-limit", default=8, type=click.IntRange(1), help="Use only the first N of --eval-prompts.")
@option("--tensorboard", default=None, metavar="DIR", type=click.Path(file_okay=False),
        help="Also write rank 0's train.step figures as TensorBoard scalars under DIR/<run_id>, named as the JSON "
        "fields (train.step/loss, train.step/tokens_per_s); needs the tensorboard extra.")
@option("--wandb", default=None, metavar="PROJECT",
        help="Also log rank 0's train.step figures to Weights & Biases PROJECT (same names as --tensorboard; run "
        "<run_id>-consumer, files in the run folder); WANDB_MODE=offline writes them locally only. Needs the wandb "
        "extra.")
@log_level_option()
@curve_options
def main(**o) -> None:
    """Train a DFlash drafter on target hidden states (one data-parallel rank)."""
    if o["eval_prompts"] and not o["eval_every"]:  # refused before torch and the target load
        fail("--eval-prompts is used by the live evaluation: give --eval-every N too")
    if not o["synthetic_batches"]:
        from dflash.protocol.peer import dial_or_exit

        dial_or_exit(o["broker"], o["curve_keys"], o["curve_name"])  # a wrong --broker said before the target loads
    from .consumer_process import ConsumerConfig, run
    from dflash.consumers.training.train_config import TrainConfig

    train_fields = set(TrainConfig.__dataclass_fields__)
    tcfg = TrainConfig(**{k: v for k, v in o.items() if k in train_fields})
    rest = {k: v for k, v in o.items() if k in ConsumerConfig.__dataclass_fields__ and k != "train"}
    rest["gpu"] = _gpu_of(o["gpu"], o["device"])
    rest["instance"] = rest["instance"] or default_instance("cpu" if rest["gpu"] is None else f"cuda{rest['gpu']}")
    run(ConsumerConfig(train=tcfg, **rest))


def _gpu_of(gpu: int | None, device: str | None) -> int | None:
    """--gpu N or --device cpu|cuda|cuda:N as the CUDA index (None: CPU)."""
    if device is None:
        return gpu
    d = device.strip().lower()
    if d == "cpu":
        index = None
    elif d == "cuda" or d.startswith("cuda:") and d[5:].isdigit():
        index = int(d[5:]) if d[4:5] == ":" else 0
    else:
        fail(f"--device {device!r}: the consumer trains on 'cpu', 'cuda' or 'cuda:N'")
    if gpu is not None and gpu != index:
        fail(f"--gpu {gpu} and --device {device} name different devices: give one of them")
    return index


if __name__ == "__main__":
    main()
