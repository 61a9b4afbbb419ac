"""Fixtures of the GSM8K example's tests: the shipped problems, a datasets cache in a temporary
folder, and a tiny HF checkpoint whose tokenizer was trained on GSM8K-style text (built once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[6]
SAMPLE = ROOT / "examples/rl/environments/gsm8k/gsm8k_sample.jsonl"


@pytest.fixture(scope="session")
def sample_rows() -> list[dict]:
    """The 20 rows of ``gsm8k_sample.jsonl``."""
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


@pytest.fixture(scope="session")
def datasets_cache(tmp_path_factory) -> str:
    """A ``cache_dir`` for ``datasets`` (the tests never write to the user's cache)."""
    return str(tmp_path_factory.mktemp("datasets_cache"))


@pytest.fixture(scope="session")
def gsm8k_checkpoint(tmp_path_factory, sample_rows) -> Path:
    """A tiny random qwen2-style checkpoint (chat template, no BOS) whose BPE tokenizer knows the
    sample's words, so its prompts are a few dozen tokens."""
    from megatron.rl.models.hf.tiny import make_tiny_checkpoint

    corpus = [row["question"] for row in sample_rows] + [row["answer"] for row in sample_rows]
    corpus.append("Please reason step by step, and put your final answer within \\boxed{}.")
    out = tmp_path_factory.mktemp("gsm8k_tiny") / "qwen2"
    return make_tiny_checkpoint("qwen2", out, corpus=corpus, tokenizer_vocab_size=700, seed=3)
