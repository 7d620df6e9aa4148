"""Assemble a producer from its config: target, tokenizer, dataset, encoder, regenerator.

Split from the loop so the network phase can announce what it loaded (`hello_config`)
before it has a work source to hand the producer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash.runtime import targets
from dflash.runtime.logs import get_logger

from .chat import ChatEncoder
from .producer_config import ProducerConfig
from .data import DataSource, open_dataset
from .packing import PackingError, check_packing
from .producer import BatchSink, Producer, WorkSource
from .regenerate import LOOP_RULE, RegenCache, Regenerator, cache_key
from .target import Target, attn_candidates, load_target, resolve_device

log = get_logger()


@dataclass
class Components:
    target: Target
    tokenizer: object
    dataset: DataSource
    encoder: ChatEncoder
    regenerator: Regenerator | None = None
    target_id: dict | None = None  # runtime/target_heads.py identity: the run's fact every role checks


def load_components(cfg: ProducerConfig) -> Components:
    """Load everything `cfg` names. Raises TargetError, PackingError, FileNotFoundError,
    DFlashError (dataset format), ValueError (tokenizer/template), OSError (checkpoint)."""
    cfg.check()
    device = resolve_device(cfg.gpu, cfg.device)
    if cfg.tensor_parallel and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU (shard.rank_device)
    dataset = open_dataset(cfg.data)
    tokenizer = targets.load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code)
    encoder = ChatEncoder(tokenizer, cfg.max_length, cfg.template_kwargs())
    target = load_target(cfg.target, cfg.target_layers, device=device, dtype=cfg.dtype,
                         attn_impl=cfg.attn_impl, full=cfg.regenerate, final=cfg.final_hidden,
                         trust_remote_code=cfg.trust_remote_code, tensor_parallel=cfg.tensor_parallel)
    if cfg.tensor_parallel:  # rank 0 (producer_process.py): the followers run every forward pass with us from here on
        from .shard import Leader

        target.shard = Leader(target.device)
    if cfg.check_packing:
        try:
            err, leak = _check_packing(target, auto_attn=cfg.attn_impl == "auto")
        except BaseException:
            if target.shard is not None:
                target.shard.stop()
            raise
        log.info("produce.packing_check", ok=not target.per_sequence, rel_err=err, leak_rel_err=leak,
                 attn_impl=target.info.attn_impl, per_sequence=target.per_sequence)
    regenerator = None
    if cfg.regenerate:
        loops = replace(LOOP_RULE, keep=cfg.regen_loop_keep) if cfg.regen_loops else None
        key = cache_key(dataset.fingerprint, target, tokenizer, cfg.max_new_tokens, cfg.template_kwargs(), loops)
        cache = RegenCache(Path(cfg.regen_cache), key)
        log.info("produce.regen_cache", path=str(cache.path), key=key, rows_cached=len(cache))
        regenerator = Regenerator(target, tokenizer, cache, max_new_tokens=cfg.max_new_tokens,
                                  batch_size=cfg.regen_batch_size, template_kwargs=cfg.template_kwargs(),
                                  loops=loops, drop=cfg.drop())
    return Components(target, tokenizer, dataset, encoder, regenerator, target_identity(cfg.target))


def target_identity(path: str) -> dict | None:
    """The target's identity as consumers compute it (config and heads hashes), or None
    where the folder does not hold them in safetensors (then the broker cannot check it)."""
    from dflash.runtime.target_heads import TargetLoadError, identity_of

    try:
        return identity_of(path)
    except (TargetLoadError, OSError) as e:
        log.warning("produce.target_unidentified", target=path, error=str(e)[:300])
        return None


def _check_packing(target: Target, auto_attn: bool) -> tuple[float, float]:
    """check_packing on the loaded attention. auto: one that cannot run or leaks gives way to the
    next, loudly, and if none packs, one sequence per pass: never a silent leak. An explicit
    --attn-impl that leaks raises PackingError naming what packs."""
    options = attn_candidates("auto", target.device, type(target.decoder), target.decoder.config)
    first = target.info.attn_impl
    if not auto_attn:
        try:
            return check_packing(target.capture, target.info.vocab_size)
        except PackingError as e:
            raise PackingError(f"{e} with --attn-impl {first}; {_advice(target, options, first)}") from None
    order = [first] + [o for o in options if o != first]
    tried: dict[str, str] = {}
    runs: list[tuple[str, float, float]] = []  # implementations that ran (and leaked)
    for i, impl in enumerate(order):
        known = _cannot_run(target, impl)
        if known:
            tried[impl] = error = known
            if i + 1 < len(order):
                log.warning("produce.attn_fallback", attn_impl=impl, to=order[i + 1], error=error)
            continue
        if impl != target.info.attn_impl:
            target.set_attn(impl)
        try:
            return check_packing(target.capture, target.info.vocab_size)
        except PackingError as e:
            tried[impl] = "leaks across packed sequences"
            runs.append((impl, e.err, e.leak))
            error = str(e)
        except Exception as e:  # noqa: BLE001  (it cannot run here: the next one may)
            tried[impl] = error = f"{type(e).__name__}: {str(e)[:200]}"
        if i + 1 < len(order):
            log.warning("produce.attn_fallback", attn_impl=impl, to=order[i + 1], error=error[:300])
    if not runs:
        raise PackingError(f"no attention implementation of this model runs here: {tried}")
    impl, err, leak = runs[0]
    target.set_attn(impl)
    target.per_sequence = True
    log.warning("produce.per_sequence", attn_impl=impl, tried=tried,
                hint="no attention implementation of this model keeps packed sequences apart here: each forward "
                     "pass takes one sequence (--max-batch-size 1), which is correct but slower")
    return err, leak


def _cannot_run(target: Target, impl: str) -> str | None:
    """Why `impl` cannot run here, known up front: flex refuses sinks on CPU, but only after a long compile."""
    if impl == "flex_attention" and target.device.type == "cpu" and any(
            isinstance(getattr(m, "sinks", None), torch.Tensor) for m in target.decoder.modules()):
        return "attention sinks cannot run on CPU with flex attention (transformers refuses them)"
    return None


def _advice(target: Target, options: list[str], current: str) -> str:
    """What packs correctly here, for the error of an explicit --attn-impl that leaks."""
    good = []
    try:
        for impl in (o for o in options if o != current and not _cannot_run(target, o)):
            try:
                target.set_attn(impl)
                check_packing(target.capture, target.info.vocab_size)
                good.append(impl)
            except Exception:  # noqa: BLE001  (leaks or cannot run: not advised)
                continue
    finally:
        target.set_attn(current)
    if good:
        return f"packs correctly on this model here: --attn-impl {' or '.join(good)} (or auto)"
    return ("no attention implementation of this model packs correctly here: --attn-impl auto runs one sequence "
            "per forward pass (or give --max-batch-size 1 --no-check-packing)")


def hello_config(c: Components, cfg: ProducerConfig) -> dict:
    """What the broker checks against the run (PROTOCOL.md 4.1 `hello.config`)."""
    return {
        "target": cfg.target, "layer_ids": c.target.layer_ids, "hidden_size": c.target.hidden_size,
        "vocab_size": c.target.info.vocab_size, "target_id": c.target_id,
        "dataset": {"n_samples": len(c.dataset), "fingerprint": c.dataset.fingerprint},
        "encodings": [cfg.hidden_encoding], "dtype": c.target.info.dtype,
        "model_type": c.target.info.model_type, "num_layers": c.target.num_layers,
        "regenerate": cfg.regenerate, "max_length": cfg.max_length,
        "revoke": True,  # it gives back batches not started when another producer has none (4.3)
    }


def make_producer(cfg: ProducerConfig, c: Components, source: WorkSource, sink: BatchSink,
                  name: str = "local") -> Producer:
    """The producer of `cfg` over components `c`; `name` (its peer ID) names its batches."""
    # per_sequence: nothing keeps packed sequences apart on this model (_check_packing)
    return Producer(c.target, c.dataset, c.encoder, source, sink, name=name, token_budget=cfg.token_budget,
                    max_batch_size=1 if c.target.per_sequence else cfg.max_batch_size, prefetch=cfg.prefetch,
                    skip_bad_rows=cfg.skip_bad_rows, hidden_encoding=cfg.hidden_encoding,
                    regenerator=c.regenerator, regen_ahead=cfg.regen_ahead)
