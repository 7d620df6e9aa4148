"""Assemble a producer from its config: target, tokenizer, dataset, encoder, regenerator.

Split from the loop so the network phase can announce what it loaded (`hello_config`)
before it has a work source to hand the producer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.protocol import targets
from dflash.protocol.logs import get_logger

from .chat import ChatEncoder
from .config import ProducerConfig
from .data import DataSource, open_dataset
from .packing import PackingError, check_packing
from .producer import BatchSink, Producer, WorkSource
from .regenerate import RegenCache, Regenerator, cache_key
from .target import Target, load_target, resolve_device

log = get_logger()


@dataclass
class Components:
    target: Target
    tokenizer: object
    dataset: DataSource
    encoder: ChatEncoder
    regenerator: Regenerator | None = None
    target_id: dict | None = None  # consumers.target_heads identity: the run's fact every role checks


def load_components(cfg: ProducerConfig) -> Components:
    """Load everything `cfg` names. Raises TargetError, PackingError, FileNotFoundError,
    DFlashError (dataset format), ValueError (tokenizer/template), OSError (checkpoint)."""
    cfg.check()
    device = resolve_device(cfg.gpu, cfg.device)
    dataset = open_dataset(cfg.data)
    tokenizer = targets.load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code)
    encoder = ChatEncoder(tokenizer, cfg.max_length, cfg.template_kwargs())
    target = load_target(cfg.target, cfg.target_layers, device=device, dtype=cfg.dtype,
                         attn_impl=cfg.attn_impl, full=cfg.regenerate, final=cfg.final_hidden,
                         trust_remote_code=cfg.trust_remote_code)
    if cfg.check_packing:
        err, leak = _check_packing(target, auto_attn=cfg.attn_impl == "auto")
        log.info("produce.packing_check", ok=True, rel_err=err, leak_rel_err=leak, attn_impl=target.info.attn_impl)
    regenerator = None
    if cfg.regenerate:
        key = cache_key(dataset.fingerprint, target, tokenizer, cfg.max_new_tokens, cfg.template_kwargs())
        cache = RegenCache(Path(cfg.regen_cache), key)
        log.info("produce.regen_cache", path=str(cache.path), key=key, rows_cached=len(cache))
        regenerator = Regenerator(target, tokenizer, cache, max_new_tokens=cfg.max_new_tokens,
                                  batch_size=cfg.regen_batch_size, template_kwargs=cfg.template_kwargs())
    return Components(target, tokenizer, dataset, encoder, regenerator, target_identity(cfg.target))


def target_identity(path: str) -> dict | None:
    """The target's identity as consumers compute it (config and heads hashes), or None
    where the folder does not hold them in safetensors (then the broker cannot check it)."""
    from dflash.consumers.target_heads import TargetLoadError, identity_of

    try:
        return identity_of(path)
    except (TargetLoadError, OSError) as e:
        log.warning("produce.target_unidentified", target=path, error=str(e)[:300])
        return None


def _check_packing(target: Target, auto_attn: bool) -> tuple[float, float]:
    """check_packing; if an automatically chosen flex/flash attention cannot even run here
    (no compiler for torch.compile, a kernel missing), fall back to sdpa once, loudly."""
    try:
        return check_packing(target.capture, target.info.vocab_size)
    except PackingError:
        raise
    except Exception as e:
        if not auto_attn or target.info.attn_impl == "sdpa":
            raise
        log.warning("produce.attn_fallback", attn_impl=target.info.attn_impl, to="sdpa",
                    error=f"{type(e).__name__}: {str(e)[:300]}")
        target.set_attn("sdpa")
        return check_packing(target.capture, target.info.vocab_size)


def hello_config(c: Components, cfg: ProducerConfig) -> dict:
    """What the broker checks against the run (PROTOCOL.md 4.1 `hello.config`)."""
    return {
        "target": cfg.target, "layer_ids": c.target.layer_ids, "hidden_size": c.target.hidden_size,
        "target_id": c.target_id,
        "dataset": {"n_samples": len(c.dataset), "fingerprint": c.dataset.fingerprint},
        "encodings": [cfg.hidden_encoding], "dtype": c.target.info.dtype,
        "model_type": c.target.info.model_type, "num_layers": c.target.num_layers,
        "regenerate": cfg.regenerate, "max_length": cfg.max_length,
    }


def make_producer(cfg: ProducerConfig, c: Components, source: WorkSource, sink: BatchSink) -> Producer:
    return Producer(c.target, c.dataset, c.encoder, source, sink, token_budget=cfg.token_budget,
                    max_batch_size=cfg.max_batch_size, prefetch=cfg.prefetch,
                    skip_bad_rows=cfg.skip_bad_rows, hidden_encoding=cfg.hidden_encoding,
                    regenerator=c.regenerator)
