"""Both engines speak ``InferenceEngine`` and both step executors speak ``RowRunner``.

``runtime_checkable`` only checks member names; the behaviour of each implementation is tested in
``test_engine.py``/``test_kv_cache.py`` (local) and ``test_dynamic_engine.py`` (megatron-core).
This module pins the signatures: the adapter must not drift from the protocol.
"""

from __future__ import annotations

import inspect

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference import protocol
from megatron.rl.inference.dynamic_engine import (
    DynamicEngineConfig,
    DynamicEngineRunner,
    DynamicInferenceEngineAdapter,
    SeededSampler,
    WindowedStepGroup,
)
from megatron.rl.inference.engine import LocalEngineConfig, LocalInferenceEngine
from megatron.rl.inference.model_runner import ModelRunner
from megatron.rl.rollout.generator import BatchScheduler

MEMBERS = [
    name
    for name, value in vars(protocol.InferenceEngine).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
]


def engines():
    local = LocalInferenceEngine(FakeSteps(), LocalEngineConfig(), lambda: 0)
    runner = DynamicEngineRunner(object(), SeededSampler(8), DynamicEngineConfig())
    dynamic = DynamicInferenceEngineAdapter(
        WindowedStepGroup(runner), LocalEngineConfig(), lambda: 0
    )
    return [local, dynamic]


@pytest.mark.parametrize("engine", engines(), ids=["local", "dynamic"])
def test_engines_satisfy_the_engine_protocol(engine):
    assert isinstance(engine, protocol.InferenceEngine)
    for name in MEMBERS:
        want = getattr(protocol.InferenceEngine, name)
        got = getattr(type(engine), name)
        if isinstance(want, property):
            assert isinstance(got, property), name
            continue
        assert inspect.signature(got) == inspect.signature(want), name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name


@pytest.mark.parametrize("engine", engines(), ids=["local", "dynamic"])
@pytest.mark.parametrize("hint", ["expect_group", "group_done", "await_batch"])
def test_engines_take_the_generators_schedule_hints(engine, hint):
    want = inspect.signature(getattr(BatchScheduler, hint))
    assert inspect.signature(getattr(type(engine), hint)) == want


@pytest.mark.parametrize("runner", [ModelRunner, DynamicEngineRunner], ids=["local", "dynamic"])
def test_step_executors_satisfy_the_row_runner_protocol(runner):
    assert inspect.signature(runner.run) == inspect.signature(protocol.RowRunner.run)


def test_protocol_is_runtime_checkable_against_a_non_engine():
    assert not isinstance(object(), protocol.InferenceEngine)
    assert not isinstance(object(), protocol.RowRunner)
