"""Fixtures shared by unit and functional tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from grpo_testing.distributed import init_single_rank_world
from megatron.core import parallel_state


@pytest.fixture
def single_rank_world():
    """A gloo world of one rank; megatron-core's parallel state is torn down afterwards."""
    init_single_rank_world()
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_hf_checkpoints(tmp_path_factory):
    """family -> directory of a tiny random Hugging Face checkpoint with its tokenizer, built
    once per session (read-only in tests)."""
    from grpo_testing.hf_models import make_checkpoints

    return make_checkpoints(tmp_path_factory.mktemp("tiny_hf"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where CUDA is not available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
