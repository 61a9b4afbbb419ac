"""The scheduler speaks ``InferenceEngine`` and both row runners speak ``RowRunner``.

``runtime_checkable`` only checks member names; the behaviour of each implementation is tested in
``test_scheduler.py``/``test_kv_cache.py`` (KV-cache runner) and ``test_dynamic_engine.py``
(megatron-core runner). This module pins the signatures: implementations must not drift from the
protocol.
"""

from __future__ import annotations

import inspect

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference import protocol
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.megatron_core.dynamic_runner import (
    DynamicEngineConfig,
    DynamicEngineRowRunner,
    SeededSampler,
)
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig


def members(cls: type) -> list[str]:
    """Public methods and properties a protocol class declares itself."""
    return [
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]


@pytest.mark.parametrize("proto", [protocol.InferenceEngine, protocol.BatchScheduler])
def test_the_scheduler_satisfies_the_engine_protocol(proto):
    engine = ContinuousBatchingScheduler(FakeSteps(), SchedulerConfig(), lambda: 0)
    assert isinstance(engine, proto)
    assert members(proto)
    for name in members(proto):
        want, got = getattr(proto, name), getattr(type(engine), name)
        assert inspect.signature(got) == inspect.signature(want), name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name


@pytest.mark.parametrize(
    "runner",
    [
        KVCacheRowRunner.__new__(KVCacheRowRunner),
        DynamicEngineRowRunner(object(), SeededSampler(8), DynamicEngineConfig()),
    ],
    ids=["kv_cache", "dynamic"],
)
def test_both_row_runners_satisfy_the_row_runner_protocol(runner):
    assert isinstance(runner, protocol.RowRunner)
    for name in members(protocol.RowRunner):
        want, got = getattr(protocol.RowRunner, name), getattr(type(runner), name)
        assert inspect.signature(got) == inspect.signature(want), name


def test_protocols_are_runtime_checkable_against_a_non_engine():
    assert not isinstance(object(), protocol.InferenceEngine)
    assert not isinstance(object(), protocol.RowRunner)
