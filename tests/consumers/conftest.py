import pytest
import torch

from consumer_helpers import tiny_target


@pytest.fixture(autouse=True)
def _few_threads():
    # The CI machine has two cores shared with other test runs.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """A tiny untied Qwen3 target saved with save_pretrained (one safetensors file)."""
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def heads(target_dir):
    from dflash.consumers.target_heads import load_target_heads

    return load_target_heads(target_dir, dtype=torch.float32)
