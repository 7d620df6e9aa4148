"""The target's decoder layers a drafter starts from (`dflash-consume --draft-init first|last`): only
the asked layers' tensors are read, from a HF folder (single file or sharded) or a GGUF file's
converted folder (runtime/targets.py, made if missing), named as inside one layer
(`self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dflash.runtime import targets
from dflash.runtime.progress import ticking
from dflash.runtime.target_heads import TargetLoadError, read_tensor, tensor_locations

# `<prefix>layers.<i>.<name>`: `model.` for a causal LM, `model.language_model.` inside a multimodal wrapper
LAYER_KEY = re.compile(r"^(?P<prefix>(?:.+?\.)?)layers\.(?P<layer>\d+)\.(?P<name>.+)$")


def load_target_layers(path: str | Path, layer_ids: list[int], *, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> dict[int, dict[str, torch.Tensor]]:
    """Target layer i -> {name inside the layer: tensor} for each of `layer_ids`, in `dtype` on `device`.
    Raises TargetLoadError."""
    g = targets.gguf_path(path)
    if g is None:
        return _from_folder(Path(path), layer_ids, device, dtype)
    # de-quantised whole by transformers (with its per-family fix-ups: llama.cpp's q/k row order), once,
    # into the cached folder every role reads; in the producer's --dtype auto for this device
    folder = targets.converted_folder(g) or targets.cached_gguf_folder(
        g, torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    if folder is not None:
        return _from_folder(folder, layer_ids, device, dtype)
    weights = targets.load_causal_lm(g, dtype=torch.float32).state_dict()  # the GGUF cache is off
    return {i: {n: weights[key].to(device=device, dtype=dtype) for n, key in layer.items()}
            for i, layer in _pick(weights, layer_ids, str(g)).items()}


def _from_folder(folder: Path, layer_ids: list[int], device, dtype) -> dict[int, dict[str, torch.Tensor]]:
    where = tensor_locations(folder)
    with ticking(f"read layers {layer_ids} of {folder.name}", end_line=False):
        return {i: {n: read_tensor(key, where[key], device, dtype) for n, key in layer.items()}
                for i, layer in _pick(where, layer_ids, str(folder)).items()}


def _pick(keys, layer_ids: list[int], source: str) -> dict[int, dict[str, str]]:
    """Layer i -> {name inside the layer: its key among `keys`} for each of `layer_ids`; the decoder's
    keys are the ones under the one `<prefix>layers.` that is not a vision tower's."""
    found: dict[str, dict[int, dict[str, str]]] = {}
    for key in keys:
        m = LAYER_KEY.match(key)
        if m and "vision" not in key and "visual" not in key:
            found.setdefault(m["prefix"], {}).setdefault(int(m["layer"]), {})[m["name"]] = key
    if len(found) != 1:
        what = f"several ({', '.join(sorted(found))})" if found else "no"
        raise TargetLoadError(f"{source} has {what} decoder layer stacks (keys '<prefix>layers.<i>.<name>')")
    [stack] = found.values()
    missing = [i for i in layer_ids if i not in stack]
    if missing:
        raise TargetLoadError(f"{source} has no decoder layer {missing[0]} (it holds layers 0..{max(stack)})")
    return {i: stack[i] for i in layer_ids}
