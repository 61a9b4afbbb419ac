"""The inference backends a tier can run its engine steps on: a small registry of specs.

A backend is the ``protocol.RowRunner`` under the shared scheduler (``ContinuousBatchingScheduler``
and ``StepGroup`` are the same for every backend). Each one lives in its own package of
``megatron/rl/inference/`` and is described here by an ``InferenceBackend`` spec, in the manner of
megatron-core's ``ModuleSpec``: a name, a description and the provider that builds the row runner
from a ``RunnerInputs`` (what the tier passes: its model, the scheduler's capacity, the vocabulary,
the device and the tensor-parallel group). The provider is an import path
(``"package.module:function"``) resolved only when a runner is built, so importing this module
imports no backend (and not megatron-core's inference engine).

* ``cpu``: ``cpu.kv_cache_runner.KVCacheRowRunner``, the trained model with a per-slot KV cache.
* ``megatron_core``: ``megatron_core.dynamic_runner.DynamicEngineRowRunner``, megatron-core's
  ``DynamicInferenceEngine`` on the trained model (needs CUDA).

A tier runs ``backend(DEFAULT_BACKEND[tier.name])`` (``Tier.inference_backend``). A new backend is
a package with a provider and one entry of ``BACKENDS``; the scheduler, generator and servers do
not change.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.rl.inference.protocol import RowRunner
    from megatron.rl.inference.requests import SchedulerConfig


@dataclass(frozen=True)
class RunnerInputs:
    """What a tier gives a backend's provider to build this rank's row runner."""

    model: torch.nn.Module
    """This rank's model (its tensor-parallel shard and, on CUDA, its pipeline stage): the runner
    generates with the trained weights themselves."""
    config: SchedulerConfig
    """The scheduler's limits per data-parallel replica (``max_requests`` slots of up to
    ``max_seq_len`` tokens, ``eos_id``)."""
    vocab_size: int
    """The tokenizer's vocabulary: tokens are sampled below it."""
    device: torch.device
    """This rank's device."""
    tp_group: dist.ProcessGroup | None = None
    """The tensor-parallel group of this rank's replica (None: no tensor parallelism)."""
    tp_size: int = 1
    """Its size."""
    compute_dtype: torch.dtype | None = None
    """Matrix products under ``torch.autocast`` in this dtype (the CPU tier's ``--bf16``); None:
    the model's own dtype."""
    padded_vocab_size: int | None = None
    """Rows of the model's output layer (the vocabulary padded for TP); the ``megatron_core``
    backend needs it."""
    pg_collection: ProcessGroupCollection | None = None
    """megatron-core's process groups ``model`` was built with, when they are not its parallel
    state (an inference copy on a layout of its own: ``tp`` is ``tp_group``); the
    ``megatron_core`` backend builds its context and model wrapper on them."""


RunnerProvider = Callable[[RunnerInputs], "RowRunner"]
"""Builds a backend's row runner on this rank."""


@dataclass(frozen=True)
class InferenceBackend:
    """One inference backend: its name, what it is, and how to build its row runner."""

    name: str
    """Registry key."""
    description: str
    """One line for logs and errors."""
    provider: str | RunnerProvider
    """``RunnerInputs -> RowRunner``: a callable, or its import path ``"package.module:attr"``
    (imported only when ``build`` or ``resolve`` is called)."""

    def resolve(self) -> RunnerProvider:
        """The provider callable (its module imported if the provider is an import path)."""
        if callable(self.provider):
            return self.provider
        module, _, attr = self.provider.partition(":")
        if not module or not attr:
            raise ValueError(
                f"inference backend {self.name!r}: provider {self.provider!r} is not "
                "'package.module:attribute'"
            )
        return getattr(importlib.import_module(module), attr)

    def build(self, inputs: RunnerInputs) -> RowRunner:
        """This rank's row runner."""
        return self.resolve()(inputs)


BACKENDS: dict[str, InferenceBackend] = {
    spec.name: spec
    for spec in (
        InferenceBackend(
            name="cpu",
            description="KV-cache row runner (the trained model with a per-slot KV cache)",
            provider="megatron.rl.inference.cpu.kv_cache_runner:build_kv_cache_runner",
        ),
        InferenceBackend(
            name="megatron_core",
            description="megatron-core DynamicInferenceEngine on the trained model (CUDA)",
            provider="megatron.rl.inference.megatron_core.dynamic_engine:build_dynamic_runner",
        ),
    )
}
"""Every inference backend, by name."""

DEFAULT_BACKEND: dict[str, str] = {"cpu": "cpu", "cuda": "megatron_core"}
"""The backend each tier (``Tier.name``) runs."""


def backend(name: str) -> InferenceBackend:
    """The backend called ``name``; ``ValueError`` naming the known backends if there is none."""
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(f"unknown inference backend {name!r}; known backends: {known}") from None


def default_backend(tier: str) -> InferenceBackend:
    """The backend the tier called ``tier`` runs (``DEFAULT_BACKEND``)."""
    try:
        name = DEFAULT_BACKEND[tier]
    except KeyError:
        known = ", ".join(sorted(DEFAULT_BACKEND))
        raise ValueError(
            f"no default inference backend for tier {tier!r}; tiers: {known}"
        ) from None
    return backend(name)
