"""The only parts of the target a drafter consumer touches: its config, `embed_tokens` and `lm_head`,
loaded frozen from a HF folder or GGUF file, and the target's identity computed from them (`identity_of`).

A consumer must never load the whole target: only the shards holding the two tensors are opened.
Names and embedding scale come from transformers' own model class built on the meta device.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dflash.runtime import targets
from dflash.runtime.progress import ticking

# Where checkpoints keep the two tensors when transformers cannot build the model class.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "transformer.wte.weight",
)
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


class TargetLoadError(ValueError):
    """The target folder lacks what a consumer needs or disagrees with itself (bad input)."""


@dataclass(frozen=True)
class TargetSpec:
    """The target's shape fields a drafter copies (docs/DESIGN.md: draft layers mirror the target)."""

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
    def from_config(cls, raw) -> "TargetSpec":
        """Parse a config.json dict or a transformers config; TargetLoadError names a missing field."""
        obj = raw if not isinstance(raw, dict) else config_object(raw)
        if obj is None:  # a model_type transformers does not know: the keys as spelled
            return cls._from_raw(raw)
        text = obj.get_text_config()
        if isinstance(raw, dict):  # a config class fills what the file lacks with defaults: refuse that
            _require(raw, type(text))
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        # transformers 5 nests rope_theta in rope_parameters; 4.x keeps it top level
        rope = getattr(text, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", None) or 10000.0)
        tie = getattr(obj, "tie_word_embeddings", None)  # the top level decides for multimodal wrappers
        return cls(
            model_type=str(text.model_type or "unknown"),
            hidden_size=hidden,
            intermediate_size=int(_first(text, "intermediate_size", "ffn_hidden_size", "n_inner") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=int(_first(text, "num_key_value_heads", "num_kv_heads") or heads),
            head_dim=int(_first(text, "head_dim") or hidden // heads),
            num_hidden_layers=int(text.num_hidden_layers),
            vocab_size=int(text.vocab_size),
            rms_norm_eps=float(_first(text, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps") or 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=int(_first(text, "max_position_embeddings") or 32768),
            tie_word_embeddings=bool(tie if tie is not None else getattr(text, "tie_word_embeddings", False)),
        )

    @classmethod
    def _from_raw(cls, raw: dict) -> "TargetSpec":
        cfg = {**raw, **raw.get("text_config", {})}
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
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
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            )
        except KeyError as e:
            raise TargetLoadError(f"target config.json lacks {e.args[0]!r}") from None


def _first(cfg, *names):
    """The first of `names` the config has a value for (families spell a few fields their own way)."""
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


# Fields a config.json must state (or its family's spelling of them) to shape a drafter.
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def _require(raw: dict, text_cls) -> None:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    aliases = getattr(text_cls, "attribute_map", {}) or {}
    for k in REQUIRED:
        if k not in text and aliases.get(k) not in text:
            raise TargetLoadError(f"target config.json lacks {k!r}" + (f" (or {aliases[k]!r})" if k in aliases else ""))


def config_object(raw: dict):
    """The transformers config of a config.json dict, or None for a model_type it does not know."""
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except (TypeError, ValueError) as e:
        raise TargetLoadError(f"target config.json is not a valid {model_type} config: {e}") from None


@dataclass(frozen=True)
class Vocabulary:
    """Where the model class keeps its two vocabulary tensors, and the factor its embedding scales a row by."""

    embed_names: tuple[str, ...]
    head_names: tuple[str, ...]  # empty: no output embedding module
    tied: bool
    embed_scale: float
    renamings: tuple = ()  # transformers' checkpoint key renamings (5.x), applied to file keys
    converters: tuple = ()
    prefix: str | None = None
    meta_keys: frozenset = frozenset()


def vocabulary(config) -> Vocabulary | None:
    """The model class's vocabulary tensors, from a one-layer build on the meta device; None where
    transformers cannot build it."""
    from transformers import AutoModelForCausalLM

    model = None
    for shallow in (True, False):
        cfg = _one_layer(config) if shallow else config
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
            break
        except Exception:  # noqa: BLE001  (custom code, a config the class refuses: try whole, then give up)
            model = None
    if model is None:
        return None
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    params = list(model.named_parameters(remove_duplicate=False))
    embed_names = tuple(n for n, p in params if p is emb.weight)
    head_names = tuple(n for n, p in params if out is not None and p is getattr(out, "weight", None))
    renamings, converters = _key_renamings(model)
    return Vocabulary(embed_names, head_names, bool(out is not None and out.weight is emb.weight),
                      embed_scale_of(emb), renamings, converters, getattr(model, "base_model_prefix", None),
                      frozenset(model.state_dict().keys()))


def _one_layer(config):
    cfg = copy.deepcopy(config)
    text = cfg.get_text_config()
    text.num_hidden_layers = 1
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:1]
    return cfg


def _key_renamings(model) -> tuple[tuple, tuple]:
    """transformers 5's renamings of checkpoint keys to parameter names; none in 4.x."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return (), ()
    mapping = get_model_conversion_mapping(model)
    return (tuple(m for m in mapping if isinstance(m, WeightRenaming)),
            tuple(m for m in mapping if isinstance(m, WeightConverter)))


def embed_scale_of(module: nn.Module) -> float:
    """The factor an input embedding multiplies each row by (Gemma: sqrt(hidden)); TargetLoadError if it
    does something else."""
    if not isinstance(module, nn.Embedding):
        raise TargetLoadError(f"the target's input embedding is a {type(module).__name__}, not an nn.Embedding: "
                              "cannot reproduce it from its weight alone")
    if type(module).forward is nn.Embedding.forward:
        return 1.0
    scale = getattr(module, "scalar_embed_scale", None)  # transformers 5: a float beside the buffer
    if scale is None:
        buf = getattr(module, "embed_scale", None)
        if isinstance(buf, (int, float)):
            scale = buf
        elif isinstance(buf, torch.Tensor) and buf.numel() == 1 and buf.device.type != "meta":
            scale = float(buf)
    if scale is None:
        raise TargetLoadError(f"the target's input embedding {type(module).__name__} changes the looked-up rows "
                              "and states no embed_scale: cannot reproduce what it feeds the model")
    return float(scale)


def embed_block(ids: torch.Tensor, embed: torch.Tensor | nn.Module, scale: float = 1.0) -> torch.Tensor:
    """The drafter's block input for `ids`: exactly what the target's own embedding module gives, from
    the module itself or its weight and `scale`."""
    if isinstance(embed, nn.Module):
        return embed(ids)
    x = F.embedding(ids, embed)
    if scale == 1.0:
        return x
    # as transformers computes it: a float32 scalar cast to the weight's dtype
    return x * torch.tensor(scale, dtype=torch.float32).to(embed.dtype)


@dataclass
class TargetHeads:
    """Frozen target embedding and LM head (never trained, never saved with the drafter)."""

    spec: TargetSpec
    embed: torch.Tensor  # [V, D]
    lm_head: torch.Tensor  # [V, D]; the same tensor as `embed` when tied
    identity: dict  # what makes this target this target; compared on resume
    path: str
    config: dict = field(default_factory=dict, repr=False)  # the raw config (special token IDs)
    mask_choices: dict = field(default_factory=dict, repr=False)
    embed_scale: float = 1.0  # what the target's embedding module multiplies a row by (Gemma: sqrt(hidden))

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding of `ids`, as its own embedding module computes it."""
        return embed_block(ids, self.embed, self.embed_scale)


def tensor_locations(folder: Path) -> dict[str, Path]:
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


def _resolve(names: tuple[str, ...], where: dict[str, Path], vocab: Vocabulary) -> str | None:
    """The checkpoint key holding the parameter named one of `names`, or renamed to it on load."""
    for n in names:
        if n in where:
            return n
    if not names:
        return None
    from dflash.runtime.hf_compat import renamed_key

    meta = dict.fromkeys(vocab.meta_keys, True)
    for key in where:
        if renamed_key(key, vocab.renamings, vocab.converters, vocab.prefix, meta) in names:
            return key
    return None


@dataclass(frozen=True)
class _Located:
    spec: TargetSpec
    where: dict
    embed_name: str
    head_name: str | None  # None: tied, the embedding is the head
    embed_scale: float


def _locate(folder: Path) -> tuple[_Located, dict]:
    """Spec, tensor keys and embedding scale of HF folder `folder`, and its raw config."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise TargetLoadError(f"no config.json in {folder} (expected a Hugging Face model folder)")
    raw = json.loads(cfg_file.read_text())
    spec = TargetSpec.from_config(raw)
    obj = config_object(raw)
    vocab = vocabulary(obj) if obj is not None else None
    where = tensor_locations(folder)
    embed_name = head_name = None
    looked, head_looked = EMBED_NAMES, HEAD_NAMES
    if vocab is not None:
        embed_name, looked = _resolve(vocab.embed_names, where, vocab), vocab.embed_names + EMBED_NAMES
        if not spec.tie_word_embeddings:
            head_name, head_looked = _resolve(vocab.head_names, where, vocab), vocab.head_names + HEAD_NAMES
    # A wrapper layout transformers does not rename (or no model class): the usual spellings
    embed_name = embed_name or _find(EMBED_NAMES, where, "embed_tokens.weight")
    if not spec.tie_word_embeddings:
        head_name = head_name or _find(HEAD_NAMES, where, "lm_head.weight")
    if embed_name is None:
        raise TargetLoadError(f"no embedding tensor in {folder} (looked for {', '.join(dict.fromkeys(looked))}, "
                              "and keys transformers renames to them)")
    if head_name is None and not spec.tie_word_embeddings:
        raise TargetLoadError(f"no {' or '.join(dict.fromkeys(head_looked))} in {folder} and tie_word_embeddings "
                              "is false")
    return _Located(spec, where, embed_name, head_name, vocab.embed_scale if vocab else 1.0), raw


def read_tensor(name: str, file: Path, device: str | torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if not file.is_file():
        raise TargetLoadError(f"{name} should be in {file.name}, which is missing")
    with safe_open(file, framework="pt", device="cpu") as sf:
        t = sf.get_tensor(name)
    return t.to(device=device, dtype=dtype or t.dtype)


def _fingerprint(spec: TargetSpec, embed: torch.Tensor, lm_head: torch.Tensor) -> dict:
    """Shape fields plus a hash of both heads' first rows in bf16 (so fp32 and bf16 copies agree)."""
    shape = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for t in (embed, lm_head):
        h.update(t[:16].detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    return {"model_type": spec.model_type, "config_sha256": shape, "heads_sha256": h.hexdigest()[:16]}


def identity_of(path: str | Path) -> dict:
    """The `identity` load_target_heads gives, reading only the config and the rows it hashes."""
    if (g := targets.gguf_path(path)) is not None:
        # its converted folder holds the same rows, de-quantised alike (the hash is of bf16 copies);
        # without one the vocabulary tensors are de-quantised whole
        folder = targets.converted_folder(g)
        if folder is None:
            return load_target_heads(path).identity
        path = folder
    folder = Path(path)
    loc, _raw = _locate(folder)
    where = loc.where

    def rows(name: str) -> torch.Tensor:
        if not where[name].is_file():
            raise TargetLoadError(f"{name} should be in {where[name].name}, which is missing")
        with safe_open(where[name], framework="pt", device="cpu") as sf:
            return sf.get_slice(name)[:16]

    embed = rows(loc.embed_name)
    return _fingerprint(loc.spec, embed, embed if loc.head_name is None else rows(loc.head_name))


def load_target_heads(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> TargetHeads:
    """Load config, embed_tokens and lm_head of the target at `path` (HF folder or .gguf); `dtype` None
    keeps the checkpoint's. Raises TargetLoadError."""
    if targets.gguf_path(path) is not None:
        return _load_gguf_heads(Path(path), device, dtype)
    folder = Path(path)
    loc, raw = _locate(folder)
    with ticking(f"read embed_tokens and lm_head of {folder.name}", end_line=False):
        where = loc.where
        embed = read_tensor(loc.embed_name, where[loc.embed_name], device, dtype)
        lm_head = embed if loc.head_name is None else read_tensor(loc.head_name, where[loc.head_name], device, dtype)
    return _heads(loc.spec, embed, lm_head, str(folder), raw, loc.embed_scale)


def _heads(spec: TargetSpec, embed: torch.Tensor, lm_head: torch.Tensor, path: str, raw: dict,
           embed_scale: float) -> TargetHeads:
    for name, t in (("embed_tokens", embed), ("lm_head", lm_head)):
        if t.dim() != 2 or t.shape[1] != spec.hidden_size or t.shape[0] < spec.vocab_size:
            raise TargetLoadError(
                f"{name} has shape {list(t.shape)}, config says [{spec.vocab_size}, {spec.hidden_size}]"
            )
    embed.requires_grad_(False)
    lm_head.requires_grad_(False)
    return TargetHeads(spec, embed, lm_head, _fingerprint(spec, embed, lm_head), path, raw,
                       embed_scale=embed_scale)


def _load_gguf_heads(file: Path, device, dtype: torch.dtype | None) -> TargetHeads:
    """The heads of a GGUF target, de-quantised by the `gguf` package alone (the decoder is never read)."""
    try:
        obj = targets.load_config(file)
        found = targets.gguf_tensors(file, [targets.GGUF_EMBED, targets.GGUF_HEAD])
    except (ImportError, OSError, ValueError) as e:
        raise TargetLoadError(f"cannot read GGUF target {file}: {type(e).__name__}: {e}") from None
    raw = obj.to_dict()
    spec = TargetSpec.from_config(obj)
    vocab = vocabulary(obj)
    if targets.GGUF_EMBED not in found:
        raise TargetLoadError(f"no {targets.GGUF_EMBED} in {file}")
    embed = found[targets.GGUF_EMBED].to(device=device, dtype=dtype or torch.float32)
    if spec.tie_word_embeddings or targets.GGUF_HEAD not in found:
        if not spec.tie_word_embeddings:
            raise TargetLoadError(f"no {targets.GGUF_HEAD} in {file} and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = found[targets.GGUF_HEAD].to(device=device, dtype=dtype or torch.float32)
    return _heads(spec, embed, lm_head, str(file), raw, vocab.embed_scale if vocab else 1.0)
