"""The registry of inference backends: lookup, errors, per-tier defaults, lazy imports, and that
each provider builds its backend's row runner."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.inference import backends
from megatron.rl.inference.backends import (
    BACKENDS,
    DEFAULT_BACKEND,
    InferenceBackend,
    RunnerInputs,
    backend,
    default_backend,
)
from megatron.rl.inference.protocol import RowRunner, RowWork, SlotSnapshotRunner
from megatron.rl.inference.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[4]


def test_the_registry_holds_the_cpu_and_megatron_core_backends():
    assert sorted(BACKENDS) == ["cpu", "megatron_core"]
    for name, spec in BACKENDS.items():
        assert isinstance(spec, InferenceBackend) and spec.name == name and spec.description
        assert backend(name) is spec


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend("cpu").name = "other"


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown inference backend 'vllm'.*cpu, megatron_core"):
        backend("vllm")


def test_each_tier_has_a_default_backend():
    assert DEFAULT_BACKEND == {"cpu": "cpu", "cuda": "megatron_core"}
    assert default_backend("cpu") is backend("cpu")
    assert default_backend("cuda") is backend("megatron_core")
    with pytest.raises(ValueError, match=r"tier 'tpu'.*cpu, cuda"):
        default_backend("tpu")


def test_every_default_names_a_registered_backend():
    assert set(DEFAULT_BACKEND.values()) <= set(BACKENDS)


def test_providers_resolve_to_the_backends_builders():
    from megatron.rl.inference.cpu.kv_cache_runner import build_kv_cache_runner
    from megatron.rl.inference.megatron_core.dynamic_engine import build_dynamic_runner

    assert backend("cpu").resolve() is build_kv_cache_runner
    assert backend("megatron_core").resolve() is build_dynamic_runner


def test_a_provider_may_be_a_callable_and_a_bad_import_path_is_refused():
    made = []
    spec = InferenceBackend("fake", "a stand-in", lambda inputs: made.append(inputs) or "runner")
    inputs = RunnerInputs(torch.nn.Linear(1, 1), SchedulerConfig(), VOCAB, torch.device("cpu"))
    assert spec.build(inputs) == "runner" and made == [inputs]
    with pytest.raises(ValueError, match="'package.module:attribute'"):
        InferenceBackend("bad", "no attribute", "megatron.rl.inference.cpu").resolve()


def test_the_cpu_backend_builds_a_kv_cache_row_runner(single_rank_world):
    from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner

    model = tiny_gpt(seed=0).eval()
    config = SchedulerConfig(max_requests=3, max_seq_len=16, eos_id=1)
    inputs = RunnerInputs(model, config, VOCAB, torch.device("cpu"))
    runner = backend("cpu").build(inputs)
    assert isinstance(runner, KVCacheRowRunner)
    assert isinstance(runner, RowRunner) and isinstance(runner, SlotSnapshotRunner)
    assert runner.cache.keys.shape[1] == 3 and runner.cache.keys.shape[3] == 16
    assert runner.cache.keys.dtype == torch.float32
    (result,) = runner.run([RowWork(0, (2, 3, 4), 0, 1.0, 1.0, 0, seed=5)])
    assert result.slot == 0 and 0 <= result.token < VOCAB
    bf16 = backend("cpu").build(dataclasses.replace(inputs, compute_dtype=torch.bfloat16))
    assert bf16.cache.keys.dtype == torch.bfloat16 and bf16.compute_dtype == torch.bfloat16


def test_the_megatron_core_backend_needs_the_padded_vocabulary():
    inputs = RunnerInputs(torch.nn.Linear(1, 1), SchedulerConfig(), VOCAB, torch.device("cpu"))
    with pytest.raises(ValueError, match="padded_vocab_size"):
        backend("megatron_core").build(inputs)


def test_importing_the_registry_imports_no_backend():
    """The registry names its providers by import path: importing it (and looking a backend up)
    imports neither backend, so not megatron-core's inference engine."""
    code = (
        "import sys\n"
        "from megatron.rl.inference.backends import backend, default_backend\n"
        "backend('megatron_core'), default_backend('cuda'), backend('cpu')\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron.core.inference')"
        " or m.startswith('megatron.rl.inference.cpu')"
        " or m.startswith('megatron.rl.inference.megatron_core')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[-2] == "[]", out.stdout
    assert backends.__file__.startswith(str(ROOT))
