"""`--target` checked before anything loads, saying what is wrong where transformers would blame a hub
ID, a package or the network. Imports neither torch nor transformers, so it answers at once.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _offline() -> bool:
    flags = [os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")]
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def looks_like_hub_id(value: str) -> bool:
    """`org/name` that is not a path on disk (hub IDs have exactly one slash)."""
    # models/x.gguf is a file's path, not a repository named x.gguf
    return (not Path(value).expanduser().exists() and not value.startswith((".", "/", "~")) and value.count("/") == 1
            and not value.lower().endswith(".gguf"))


def resolve_hub_id(value: str) -> str:
    """A hub ID as its snapshot folder in the local HF cache; nothing is downloaded (FileNotFoundError says how)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(value, local_files_only=True)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{value}: no such folder, and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"nothing is downloaded at run time: fetch it once with `hf download {value}` (or give a model "
            "folder)") from None
    except ValueError as e:  # a malformed ID, e.g. 'a/b c'
        raise FileNotFoundError(f"{value}: no such folder, and not a hub ID ({e})") from None


def hub_cached(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds `repo_id`'s config.json (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo ID for the hub library either
        return False


def target_problem(value: str, *, hub_ok: bool, need_tokenizer: bool) -> str | None:
    """Why `value` is not a usable --target, as a sentence saying what to do; None if it is."""
    if looks_like_hub_id(value):
        if not hub_ok:
            return (f"{value}: no such folder; this tool reads the target from a local folder (config.json, "
                    f"weights, tokenizer): download it first (e.g. `hf download {value} --local-dir DIR`) and "
                    "give DIR")
        if _offline() and not hub_cached(value):
            return (f"{value}: a hub ID that is not in the local Hugging Face cache, and downloads are off "
                    f"(HF_HUB_OFFLINE): download the model first (`hf download {value}`) or give a local "
                    "model folder")
        return None
    path = Path(value).expanduser()
    if not path.exists():
        if path.suffix.lower() == ".gguf":
            return f"{value}: no such file (a .gguf checkpoint)"
        return f"{value}: no such folder (a local model folder" + (", or a hub ID 'org/name')" if hub_ok else ")")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return None  # a GGUF checkpoint: config and tokenizer come from the file
        return f"{value} is a file, not a model folder"
    if any(path.glob("*.gguf")):
        return None
    if not (path / "config.json").is_file():
        return (f"{value} is not a model folder: it has no config.json (give the folder that save_pretrained "
                "wrote, with config.json, the weights and the tokenizer)")
    if not any(any(path.glob(p)) for p in WEIGHTS):
        return (f"{value} has a config.json but no weights (model*.safetensors or pytorch_model*.bin): give "
                "the folder that save_pretrained wrote, weights included")
    if need_tokenizer and not any((path / f).is_file() for f in TOKENIZER):
        return (f"{value} has no tokenizer files ({', '.join(TOKENIZER)}): save the tokenizer into the "
                "folder too (tokenizer.save_pretrained(folder)) or give the folder it came with")
    return None
