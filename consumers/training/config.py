"""`TrainConfig`, what the training loop is given (train.py, train_config.py): each field the
dflash-consume option of its name, declared once here. Imports neither torch nor numpy, so
that `--help` answers at once."""

from __future__ import annotations

from dataclasses import dataclass

import click

from dflash.runtime.command_line import setting


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """'1,9,17' -> (1, 9, 17); '', 'auto' -> None (the broker run's, else the default spacing).
    Raises ValueError."""
    if text in (None, "", "auto"):
        return None
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of layer IDs") from None


@dataclass(frozen=True)
class TrainConfig:
    """The training loop's settings; each field (but skip_held) is the dflash-consume option of its name."""

    # training signal (recorded in every checkpoint; see protocol/training_signal.py)
    draft_layers: int = setting(5, type=click.IntRange(1), help="Draft decoder layers (paper: 5).")
    draft_init: str = setting(  # not in the training signal: it only sets a fresh run's first weights
        "random", type=click.Choice(["random", "first", "last"]),
        help="The draft layers' first weights: random (N(0, 0.02)); first: copies of the target's first "
        "--draft-layers decoder layers; last: of its last ones (Qwen3/Llama-style layers; a resume takes the "
        "checkpoint's weights).")
    target_layers: tuple[int, ...] | None = setting(  # None: 5 layers spaced from 1 to L-3
        "auto", parse=parse_layers,
        help="Comma-separated 0-based target layer IDs fed to the drafter; auto: the broker run's (its "
        "producers'), else 5 spaced from 1 to L-3.")
    block_size: int = setting(16, type=click.IntRange(2), help="Block size B: anchor + B-1 drafted tokens.")
    anchors: int = setting(512, type=click.IntRange(1), help="At most this many anchors per sequence.")
    anchor_every: int = setting(  # docs/TRAINING.md "Anchors"
        1, type=click.IntRange(1),
        help="One anchor per this many trainable positions of a sequence (1: every one, up to --anchors).")
    gamma: float | None = setting(  # None: default_gamma(block_size)
        None, help="--loss ce decay exp(-(k-1)/gamma); default 7/5/4 for B=16/10/8, else 1+3B/8.")
    mask_token_id: int | None = setting(  # None: chosen for the target (mask_token.py)
        None, help="Vocabulary row used as MASK; default: chosen for the target (its mask token, else the first row "
        "past the tokenizer, else a reserved or unused special token: docs/TRAINING.md), never pad/eos/bos/unk.")
    distill_weight: float = setting(  # needs final_hidden batches
        0.0, type=click.FloatRange(0, 1),
        help="Knowledge distillation: loss = (1 - a) x CE(labels) + a x KL(target || drafter), the target's "
        "next-token distribution from its final hidden state (producers need --final-hidden); 0: hard labels only.")
    loss: str = setting(
        "ce", type=click.Choice(["ce", "dpace"]),
        help="ce: cross-entropy with block position k weighted exp(-(k-1)/gamma) (the DFlash paper); dpace: "
        "D-PACE (arXiv 2605.18810), weights from the drafter's own confidence in each label, the credit each "
        "position has in the expected accepted length (docs/TRAINING.md).")
    dpace_alpha: float | None = setting(  # None: 0.5 (the paper's default)
        None, type=click.FloatRange(0, 1, min_open=True),
        help="D-PACE's smoothing a in (0, 1]: each confidence q counts as (1 - a) q + a; default 0.5. "
        "Only with --loss dpace.")
    # optimisation
    lr: float = setting(6e-4, help="Peak AdamW learning rate.")
    min_lr: float = setting(0.0, help="Learning rate at the end of the cosine schedule.")
    warmup: float = setting(  # fraction of the planned work (samples, or total_steps)
        0.04, type=click.FloatRange(0, 1), help="Warmup as a fraction of the planned samples (or of --total-steps).")
    # None: the broker's planned samples, a checkpoint's, else a local stream's size
    total_samples: int | None = setting(
        None, type=click.IntRange(1),
        help="Samples the lr/noise schedules run over (warmup, then cosine to --min-lr at the last one); default: "
        "the broker's epochs x samples (less skipped ones), else a resumed checkpoint's plan, else the local "
        "stream's size; none known: constant lr, with a warning (docs/TRAINING.md).")
    total_steps: int | None = setting(
        None, type=click.IntRange(1),
        help="Schedule by optimizer steps instead of samples: the lr/noise schedules' length in steps.")
    max_steps: int | None = setting(
        None, type=click.IntRange(0), help="Stop after this many steps (default: end of stream).")
    grad_clip: float = setting(1.0, help="Clip the global gradient norm to this value.")
    weight_decay: float = setting(0.0, help="AdamW weight decay.")
    # model.py feature_scale; the export folds it into fc.weight
    feature_scaling: bool = setting(
        True, help="Standardise each target feature column before the drafter's fc, by factors set from the first "
        "batch (a pretrained target's few huge residual columns otherwise drown the context); the export folds "
        "them into fc.weight (docs/TRAINING.md).")
    feature_noise: float = setting(  # at step 0
        0.0, type=click.FloatRange(0), help="Gaussian noise on target features, relative to each layer's RMS.")
    noise_schedule: str = setting(  # decay to 0 at the plan's end
        "linear", type=click.Choice(["constant", "linear", "cosine"]),
        help="How --feature-noise decays to 0 over the planned samples (or --total-steps).")
    seed: int = setting(0, help="Seed for initialisation, anchors and noise.")
    # implementation
    loss_chunk: int = setting(
        2048, type=click.IntRange(1), help="Block positions per logits chunk (memory vs speed).")
    attn: str = setting(
        "auto", type=click.Choice(["auto", "sdpa", "flex"]),
        help="Attention kernel; auto: flex on GPU (sdpa if no C compiler can build it), sdpa on CPU. flex: "
             "block-sparse attention over the blocks, compiled on the first step (faster steps, slower start); "
             "sdpa: one masked call per sequence.")
    fuse: str = setting(  # consumers/fused.py
        "auto", type=click.Choice(["auto", "on", "off"]),
        help="Fuse the step's elementwise work (RMSNorm, RoPE, SwiGLU, the loss's softmax) with torch.compile: "
             "faster steps, slower start; auto: on on GPU (off if no C compiler can build the kernels).")
    stage_batches: bool = setting(
        True, help="Prepare the next batch on a thread while the step runs: on GPU it is copied straight from the "
             "received message to the GPU (fp8 as fp8, dequantised there) on a stream of its own, off the step's "
             "critical path; it holds one batch more in GPU memory. --no-stage-batches prepares each batch "
             "between steps, on the CPU: for a step that barely fits in GPU memory.")
    precision: str = setting(
        "auto", type=click.Choice(["auto", "bf16", "fp32"]), help="auto: bf16 autocast on GPU, fp32 on CPU.")
    # checkpoints and logs
    save_every: int = setting(1000, type=click.IntRange(0), help="Checkpoint every N steps (0: only at the end).")
    keep: int = setting(3, type=click.IntRange(1), help="Checkpoints to keep in this run.")
    resume: str | None = setting(  # checkpoint folder, run ID/folder, or "latest"
        None, help="Checkpoint folder, run ID or run folder, or 'latest', to continue from. In a broker run none is "
        "needed (the broker names the checkpoint); 'latest' where no checkpoint exists yet starts as without "
        "--resume.")
    force: bool = setting(False, help="Resume even if the training signal differs from the checkpoint's.")
    log_position_every: int = setting(
        100, type=click.IntRange(0), help="Log per-position accuracy every N steps.")
    epoch_samples: int | None = setting(  # for the epoch fraction and ETA
        None, type=click.IntRange(1),
        help="Samples per epoch, for the logged epoch fraction of a local run (with a broker: the broker's count).")
    # set by the process: on with a broker (a crash can make a sample again), off for local streams
    skip_held: bool = False
