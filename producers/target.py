"""The frozen target: load any Hugging Face decoder-only causal LM and capture the hidden
states of a few decoder layers, nothing more.

Forward hooks copy each wanted layer's output into one preallocated buffer and the last one
raises to stop the pass: any family works without re-implementing its forward. "Layer i" is
decoder layer i's output (0-based) = Hugging Face `hidden_states[i + 1]`."""

from __future__ import annotations

import importlib.util
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from dflash.runtime import targets
from dflash.runtime.targets import default_layer_ids
from dflash.runtime.logs import get_logger
from dflash.runtime.hf_compat import causal_lm_class, sharded_config

log = get_logger()

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


class TargetError(ValueError):
    """The target model or its layer selection cannot be used (reason in the message)."""


class _StopForward(Exception):
    """Raised by the last wanted layer's hook: nothing after it needs computing."""


def parse_layer_ids(spec: str | None, num_layers: int) -> list[int]:
    """`--target-layers` ("1,9,17" or empty for the default) -> validated layer IDs."""
    if not spec:
        try:
            return default_layer_ids(num_layers)
        except ValueError as e:
            raise TargetError(str(e)) from None
    try:
        ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
        raise TargetError(f"--target-layers {spec!r}: expected comma-separated integers") from None
    if not ids:
        raise TargetError("--target-layers is empty")
    if len(set(ids)) != len(ids):
        raise TargetError(f"--target-layers {spec!r} repeats a layer")
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        # the last layer's HF hidden state is post-norm: never a DFlash feature (SGLang #32204)
        raise TargetError(f"--target-layers {bad} out of range: the target has {num_layers} layers, "
                          f"usable IDs are 0..{num_layers - 2} (the last layer is never a feature)")
    return ids


def resolve_device(gpu: int | None, device: str | None) -> torch.device:
    """`--device` wins; else `--gpu N`; else cuda:0 if there is one, else CPU."""
    if device:
        return torch.device(device)
    if gpu is not None:
        if not torch.cuda.is_available():
            raise TargetError(f"--gpu {gpu} asked for, but torch sees no CUDA device (use --device cpu)")
        return torch.device("cuda", gpu)
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on GPU (the model dtype DFlash trains on), float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise TargetError(f"--dtype {name!r}: choose auto, bfloat16, float16 or float32")
    return DTYPES[name]


def attn_candidates(name: str, device: torch.device, model_cls: type | None, config=None) -> list[str]:
    """`--attn-impl` as the implementations to try, best first (the start-up packing check takes
    the first that packs correctly). auto, on GPU: flash-attention 2, flex (cost per sequence),
    sdpa (a dense [T, T] mask), eager; on CPU sdpa first. Soft-capping configs never get sdpa,
    whatever the class claims (it drops the cap)."""
    if name != "auto":
        return [name]

    def ok(flag: str) -> bool:
        return model_cls is None or bool(getattr(model_cls, flag, True))

    flash = importlib.util.find_spec("flash_attn") is not None and ok("_supports_flash_attn")
    flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None and ok("_supports_flex_attn")
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    sdpa = ok("_supports_sdpa") and not getattr(text, "attn_logit_softcapping", None)
    if device.type == "cuda":
        order = [("flash_attention_2", flash), ("flex_attention", flex), ("sdpa", sdpa), ("eager", True)]
    else:
        order = [("sdpa", sdpa), ("eager", True), ("flex_attention", flex)]
    return [impl for impl, usable in order if usable]


def find_layers(decoder: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder's ModuleList of exactly `num_layers` modules (`layers`, `h`, ... or the first such)."""
    for name in ("layers", "h", "blocks"):
        mod = getattr(decoder, name, None)
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers:
            return mod
    for _name, mod in decoder.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers:
            return mod
    raise TargetError(f"no list of {num_layers} decoder layers in {type(decoder).__name__}")


def _final_norm(decoder: nn.Module) -> nn.Module:
    """The decoder's final norm (`norm` in most families, `ln_f` in GPT-2 style ones)."""
    for name in ("norm", "ln_f", "final_layernorm"):
        mod = getattr(decoder, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise TargetError(f"no final norm (norm, ln_f, final_layernorm) in {type(decoder).__name__}: "
                      "--final-hidden needs it")


@dataclass
class TargetInfo:
    """What the broker and consumers are told about the target (hello `config`)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: list[int]
    dtype: str
    device: str
    attn_impl: str


class Target:
    """A frozen target model that captures `layer_ids` for packed varlen batches; without `full`
    (needed by `--regenerate`) the layers after the last wanted one and the LM head are dropped."""

    def __init__(self, model: nn.Module, name: str, layer_ids: list[int], *, full: bool = False,
                 final: bool = False):
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.layer_ids = list(layer_ids)
        self.decoder = model.get_decoder()
        self.layers = find_layers(self.decoder, self.num_layers)
        self.model = model if full else None  # dropping it frees an untied LM head
        self.config = model.config
        # capture hooks live on shared layers: no generation pass may run while they are registered
        self.lock = threading.Lock()
        self.capture_waiting = 0  # captures waiting for `lock` (the regeneration thread yields to them)
        self.per_sequence = False  # set by build.py's check when no attention keeps packs apart
        self.shard = None  # --tensor-parallel, rank 0: the followers (producers/shard.py Leader)
        self.final_norm = _final_norm(self.decoder) if final else None  # one more slot: HF hidden_states[-1]
        if not full and not final:
            del self.layers[max(self.layer_ids) + 1:]
        p = next(self.decoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.info = TargetInfo(
            name=name, model_type=getattr(self.config, "model_type", "?"), num_layers=self.num_layers,
            hidden_size=self.hidden_size, vocab_size=cfg.vocab_size, layer_ids=self.layer_ids,
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            attn_impl=getattr(self.config, "_attn_implementation", "?"),
        )

    def set_attn(self, name: str) -> None:
        """Switch the attention implementation in place (the start-up fallback to sdpa)."""
        if self.shard is not None:
            self.shard.set_attn(name)
        (self.model or self.decoder).set_attn_implementation(name)
        self.info.attn_impl = getattr(self.config, "_attn_implementation", name)

    @contextmanager
    def attention(self, name: str) -> Iterator[None]:
        """Run the block with attention `name`, then switch back; the caller holds `lock`."""
        before = self.info.attn_impl
        if before == name:
            yield
            return
        self.set_attn(name)
        try:
            yield
        finally:
            self.set_attn(before)

    @property
    def width(self) -> int:
        """Columns of what `capture` returns: the layers', and the final slot's if any."""
        return (len(self.layer_ids) + (self.final_norm is not None)) * self.hidden_size

    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, width] of the wanted layers for one packed batch (positions restart per
        sequence: transformers keeps them apart). OutOfMemoryError propagates: the caller splits."""
        self.capture_waiting += 1  # only the producer's main thread captures: no race on the count
        with self.lock:
            self.capture_waiting -= 1
            if self.shard is not None:
                self.shard.capture(input_ids, position_ids)
            return self._capture(input_ids.to(self.device), position_ids.to(self.device))

    def _capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        T, H = input_ids.numel(), self.hidden_size
        # one buffer filled in place: a list of layers plus a cat would double the peak
        out = torch.empty(T, self.width, dtype=self.dtype, device=self.device)  # [T, n*H]
        last = -1 if self.final_norm is not None else max(self.layer_ids)

        def hook_for(slot: int, layer_id: int):
            def hook(_module, _args, output):
                hs = output[0] if isinstance(output, tuple) else output  # [1, T, H]
                out[:, slot * H:(slot + 1) * H].copy_(hs.reshape(T, H))
                if layer_id == last:
                    raise _StopForward
            return hook

        handles = [self.layers[lid].register_forward_hook(hook_for(slot, lid))
                   for slot, lid in enumerate(self.layer_ids)]
        if self.final_norm is not None:
            handles.append(self.final_norm.register_forward_hook(hook_for(len(self.layer_ids), -1)))
        try:
            with torch.inference_mode():
                self.decoder(
                    input_ids=input_ids.view(1, T),
                    position_ids=position_ids.view(1, T),
                    attention_mask=None,  # None + restarting positions = packed varlen
                    use_cache=False,  # a cache would disable transformers' packing detection
                )
        except _StopForward:
            return out
        finally:
            for h in handles:
                h.remove()
        raise RuntimeError(f"layer {last} never ran: the decoder does not call its layer list (or final norm)")


UNEVEN_HEAD = "must be divisible by the tensor parallel size"  # transformers <= 5.2x, an uneven head


def uneven_head(name: str, config, world: int) -> str:
    import transformers

    vocab = getattr(config.get_text_config(), "vocab_size", "?")
    return (f"--tensor-parallel over {world} ranks cannot shard {name}: its output head has {vocab} rows, which "
            f"transformers {transformers.__version__} splits only in {world} equal parts; run it on a number of "
            f"ranks that divides {vocab}, or with a newer transformers (5.25 splits it unevenly)")


def _check_tp_plan(name: str, trust_remote_code: bool):
    """The text config; TargetError without a tensor-parallel plan (each rank would load it whole)."""
    config = targets.load_config(name, trust_remote_code=trust_remote_code).get_text_config()
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise TargetError(f"{getattr(config, 'model_type', name)}: transformers has no tensor-parallel plan for this "
                          "model (config base_model_tp_plan), so --tensor-parallel cannot shard it")
    return config


def load_target(
    name: str,
    layer_spec: str | None = None,
    *,
    device: torch.device | None = None,
    dtype: str = "auto",
    attn_impl: str = "auto",
    full: bool = False,
    final: bool = False,
    trust_remote_code: bool = False,
    tensor_parallel: bool = False,
) -> Target:
    """Load a local folder, hub ID or .gguf file as a frozen target on `device` (`tensor_parallel`:
    this rank's shard). Raises TargetError, or transformers' errors for an unreadable checkpoint."""
    device = device or resolve_device(None, None)
    torch_dtype = resolve_dtype(dtype, device)
    model_cls = config = None
    if attn_impl == "auto":
        config = targets.load_config(name, trust_remote_code=trust_remote_code)
        model_cls = causal_lm_class(config)
    options = attn_candidates(attn_impl, device, model_cls, config)
    t0 = time.monotonic()
    kw: dict = {}
    if tensor_parallel:
        config = _check_tp_plan(name, trust_remote_code)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        kw["distributed_config"] = sharded_config(config, world)  # each rank loads its slices only
    elif device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kw["device_map"] = {"": str(device)}  # straight to the GPU, no full CPU copy
    for i, attn in enumerate(options):
        try:
            model = targets.load_causal_lm(name, dtype=torch_dtype, attn_implementation=attn,
                                           trust_remote_code=trust_remote_code, **kw)
            break
        except ValueError as e:  # transformers refuses an implementation this model (custom code) lacks
            if tensor_parallel and UNEVEN_HEAD in str(e):  # no attention implementation changes that
                raise TargetError(uneven_head(name, config, world)) from e
            if i + 1 == len(options):
                raise
            log.warning("produce.attn_fallback", attn_impl=attn, to=options[i + 1], error=str(e)[:300])
    if not tensor_parallel:  # sharded weights are on this rank's device already
        model.to(device)
    model.eval().requires_grad_(False)
    num_layers = model.config.get_text_config().num_hidden_layers
    target = Target(model, name, parse_layer_ids(layer_spec, num_layers), full=full, final=final)
    del model
    log.info("produce.target_loaded", load_s=round(time.monotonic() - t0, 2), full=full,
             params=sum(p.numel() for p in target.decoder.parameters()), **vars(target.info))
    return target
