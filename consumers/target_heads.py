"""The only parts of the target a drafter consumer touches: its config, `embed_tokens`
and `lm_head`, loaded frozen from a Hugging Face checkpoint folder or a GGUF file
(protocol/targets.py), and the choice of the block MASK row (mask_token.py).

A consumer must never load the whole target (a 27B target is ~54 GB; the two heads are
~1.5 GB). We read the safetensors index (or the single file's header), open only the
shard(s) holding those two tensors, and `get_tensor` only their names: every other
tensor may be missing or corrupt and loading still works.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from dflash.protocol import targets
from dflash.protocol.errors import DFlashError
from dflash.protocol.target_id import describe_target, same_target  # noqa: F401  (re-exported)

# Where checkpoints keep the two tensors: plain causal LMs first, then multimodal
# wrappers (Qwen3.5/3.6-style `model.language_model.*`) and GPT-style names.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "transformer.wte.weight",
)
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


class TargetLoadError(DFlashError):
    """The target folder lacks what a consumer needs (config, heads) or disagrees with itself."""


@dataclass(frozen=True)
class TargetSpec:
    """The target's shape fields a drafter copies (DFLASH.md: draft layers mirror the target)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, raw: dict) -> "TargetSpec":
        """Parse a config.json dict (text_config of a multimodal config wins). Raises TargetLoadError."""
        cfg = {**raw, **raw.get("text_config", {})}
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # transformers 5 nests rope_theta in rope_parameters; 4.x keeps it top level.
            rope = cfg.get("rope_parameters") or {}
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            return cls(
                model_type=str(cfg.get("model_type", "unknown")),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                # The top level decides tying for multimodal wrappers.
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            )
        except KeyError as e:
            raise TargetLoadError(f"target config.json lacks {e.args[0]!r}") from None


@dataclass
class TargetHeads:
    """Frozen target embedding and LM head (never trained, never saved with the drafter)."""

    spec: TargetSpec
    embed: torch.Tensor  # [V, D]
    lm_head: torch.Tensor  # [V, D]; the same tensor as `embed` when tied
    identity: dict  # what makes this target this target; compared on resume
    path: str
    config: dict = field(default_factory=dict, repr=False)  # the raw config (special token IDs)
    # MASK choices made so far, by explicit ID (None: automatic): chosen and logged once
    mask_choices: dict = field(default_factory=dict, repr=False)


def _tensor_locations(folder: Path) -> dict[str, Path]:
    """tensor name -> file holding it, reading only the index or the files' headers."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / fname for name, fname in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetLoadError(f"no *.safetensors and no model.safetensors.index.json in {folder}")
    out: dict[str, Path] = {}
    for f in files:  # no index: each file's header lists its tensors (data is not read)
        with safe_open(f, framework="pt") as sf:
            out.update((name, f) for name in sf.keys())
    return out


def _find(names: tuple[str, ...], where: dict[str, Path], suffix: str) -> str | None:
    for n in names:
        if n in where:
            return n
    # Unknown wrappers: accept exactly one name ending like the tensor we want.
    hits = [n for n in where if n.endswith(suffix) and "vision" not in n and "visual" not in n]
    return hits[0] if len(hits) == 1 else None


def _read(name: str, file: Path, device: str | torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if not file.is_file():
        raise TargetLoadError(f"{name} should be in {file.name}, which is missing")
    with safe_open(file, framework="pt", device="cpu") as sf:
        t = sf.get_tensor(name)
    return t.to(device=device, dtype=dtype or t.dtype)


def _fingerprint(spec: TargetSpec, embed: torch.Tensor, lm_head: torch.Tensor) -> dict:
    """Shape fields plus a hash of the first rows of both heads, in bf16 so that an fp32
    and a bf16 copy of the same target agree; paths are left out (they differ per host)."""
    shape = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for t in (embed, lm_head):
        h.update(t[:16].detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    return {"model_type": spec.model_type, "config_sha256": shape, "heads_sha256": h.hexdigest()[:16]}


def identity_of(path: str | Path) -> dict:
    """The `identity` load_target_heads gives for the target at `path`, reading only its
    config and the 16 rows of each head the fingerprint hashes (a producer holds the whole
    model but may have dropped its LM head; this is what it states in hello). Raises
    TargetLoadError as load_target_heads does."""
    if targets.gguf_path(path) is not None:  # the vocabulary tensors are de-quantised whole anyway
        return load_target_heads(path).identity
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise TargetLoadError(f"no config.json in {folder} (expected a Hugging Face model folder)")
    spec = TargetSpec.from_config(json.loads(cfg_file.read_text()))
    where = _tensor_locations(folder)
    embed_name = _find(EMBED_NAMES, where, "embed_tokens.weight")
    if embed_name is None:
        raise TargetLoadError(f"no embedding tensor in {folder} (looked for {', '.join(EMBED_NAMES)})")
    head_name = None if spec.tie_word_embeddings else _find(HEAD_NAMES, where, "lm_head.weight")
    if head_name is None and not spec.tie_word_embeddings:
        raise TargetLoadError(f"no lm_head.weight in {folder} and tie_word_embeddings is false")

    def rows(name: str) -> torch.Tensor:
        if not where[name].is_file():
            raise TargetLoadError(f"{name} should be in {where[name].name}, which is missing")
        with safe_open(where[name], framework="pt", device="cpu") as sf:
            return sf.get_slice(name)[:16]

    embed = rows(embed_name)
    return _fingerprint(spec, embed, embed if head_name is None else rows(head_name))


def load_target_heads(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> TargetHeads:
    """Load config, embed_tokens and lm_head of the target at `path` (a local HF folder,
    or a .gguf file: protocol/targets.py).

    `dtype` None keeps the checkpoint's dtype. Raises TargetLoadError naming what is
    missing or inconsistent."""
    if targets.gguf_path(path) is not None:
        return _load_gguf_heads(Path(path), device, dtype)
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise TargetLoadError(f"no config.json in {folder} (expected a Hugging Face model folder)")
    raw = json.loads(cfg_file.read_text())
    spec = TargetSpec.from_config(raw)
    where = _tensor_locations(folder)
    embed_name = _find(EMBED_NAMES, where, "embed_tokens.weight")
    if embed_name is None:
        raise TargetLoadError(f"no embedding tensor in {folder} (looked for {', '.join(EMBED_NAMES)})")
    embed = _read(embed_name, where[embed_name], device, dtype)
    head_name = None if spec.tie_word_embeddings else _find(HEAD_NAMES, where, "lm_head.weight")
    if head_name is None and not spec.tie_word_embeddings:
        raise TargetLoadError(f"no lm_head.weight in {folder} and tie_word_embeddings is false")
    lm_head = embed if head_name is None else _read(head_name, where[head_name], device, dtype)
    return _heads(spec, embed, lm_head, str(folder), raw)


def _heads(spec: TargetSpec, embed: torch.Tensor, lm_head: torch.Tensor, path: str, raw: dict) -> TargetHeads:
    for name, t in (("embed_tokens", embed), ("lm_head", lm_head)):
        if t.dim() != 2 or t.shape[1] != spec.hidden_size or t.shape[0] < spec.vocab_size:
            raise TargetLoadError(
                f"{name} has shape {list(t.shape)}, config says [{spec.vocab_size}, {spec.hidden_size}]"
            )
    embed.requires_grad_(False)
    lm_head.requires_grad_(False)
    return TargetHeads(spec, embed, lm_head, _fingerprint(spec, embed, lm_head), path, raw)


def _load_gguf_heads(file: Path, device, dtype: torch.dtype | None) -> TargetHeads:
    """The heads of a GGUF target: its config through transformers' GGUF reader, the two
    tensors de-quantised by the `gguf` package alone (the decoder is never read). The
    fingerprint hashes the de-quantised rows, which are the same on every load."""
    try:
        raw = targets.load_config(file).to_dict()
        found = targets.gguf_tensors(file, [targets.GGUF_EMBED, targets.GGUF_HEAD])
    except (ImportError, OSError, ValueError) as e:
        raise TargetLoadError(f"cannot read GGUF target {file}: {type(e).__name__}: {e}") from None
    spec = TargetSpec.from_config(raw)
    if targets.GGUF_EMBED not in found:
        raise TargetLoadError(f"no {targets.GGUF_EMBED} in {file}")
    embed = found[targets.GGUF_EMBED].to(device=device, dtype=dtype or torch.float32)
    if spec.tie_word_embeddings or targets.GGUF_HEAD not in found:
        if not spec.tie_word_embeddings:
            raise TargetLoadError(f"no {targets.GGUF_HEAD} in {file} and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = found[targets.GGUF_HEAD].to(device=device, dtype=dtype or torch.float32)
    return _heads(spec, embed, lm_head, str(file), raw)
