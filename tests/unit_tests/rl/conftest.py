"""Fixtures of the ``megatron.rl`` unit tests: tiny Hugging Face checkpoints (built once)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_hf_checkpoints(tmp_path_factory):
    """family -> directory of a tiny random checkpoint with its tokenizer (read-only in tests)."""
    from grpo_testing.hf_models import make_checkpoints

    return make_checkpoints(tmp_path_factory.mktemp("tiny_hf"))
