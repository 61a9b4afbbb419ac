"""megatron-core's ``DynamicInferenceEngine``, built on the trained model for the CUDA tier.

``build_dynamic_runner`` (the ``megatron_core`` backend's provider, ``backends.BACKENDS``) gives a
rank its ``DynamicEngineRowRunner`` (``dynamic_runner.py``), which the scheduler drives exactly like
the CPU tier's KV-cache runner; ``build_dynamic_step_group`` puts one under a ``StepGroup``.
The subclasses here adapt megatron-core to being stepped row by row:

* ``SeededSamplingController``: megatron-core's controller sampling with the trainer's
  ``SeededSampler`` (per-request seeded uniforms); with ``record_routing``, it also hands the
  sampler each request's routes of the step (the routers record every forward:
  ``routing_replay.start_recording``).
* ``SteppedDynamicInferenceEngine``: the engine on a detached loop (the runner steps it; its
  serving loop never runs), with a fix of megatron-core 0.16/0.17's ``resume`` and
  ``InferenceMode`` (0.18+) on only during its steps.

What differs between megatron-core releases (0.16.1 to 0.19.x) is adapted in ``compat.py``.
Constructing megatron-core's engine needs CUDA; installs ``flash_reference`` where flash-attn is
missing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import math
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from megatron.rl.inference.megatron_core import compat, flash_reference
from megatron.rl.inference.megatron_core.dynamic_runner import (
    DynamicEngineConfig,
    DynamicEngineRowRunner,
    SeededSampler,
    split_routes,
)
from megatron.rl.inference.scoring import ScoringForward
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.models.routing_replay import recorded_routes, routing_replays, start_recording

if TYPE_CHECKING:
    from megatron.rl.inference.backends import RunnerInputs


class SeededSamplingController(TextGenerationController):
    """megatron-core's controller with the trainer's per-request seeded sampling."""

    def __init__(
        self,
        inference_wrapped_model,
        tokenizer,
        sampler: SeededSampler,
        routed_model: torch.nn.Module | None = None,
        pg_collection: Any = None,
    ):
        groups = compat.controller_arguments(TextGenerationController, pg_collection)
        super().__init__(inference_wrapped_model, tokenizer, **groups)
        self.sampler = sampler
        self.routed_model = routed_model
        """The model whose routers record each step (``sampler.record_routing``)."""

    def _dynamic_step_sample_bookkeeping(self) -> None:
        """Nothing to prepare: parameters are looked up per request in ``sample`` (megatron-core
        0.16 and 0.17 call this hook; 0.18+ has none)."""

    def _dynamic_step_sample_logits(self, logits: torch.Tensor | None = None) -> None:
        """Sample every active request's next token into megatron-core's token buffer (the
        logits are the argument up to 0.17, the controller's own buffer from 0.18 on)."""
        logits = compat.step_logits(self, logits)
        context = self.inference_wrapped_model.inference_context
        active = slice(context.paused_request_count, context.total_request_count)
        count = active.stop - active.start
        if compat.only_last_token_logits(context):
            last = logits.squeeze(0)[:count]
        else:
            last = context.last_token_logits(logits)[:count]
        request_ids = context.request_ids[active].tolist()
        positions = (
            context.request_kv_length_offsets[active] + context.request_query_lengths[active]
        ).tolist()
        tokens = self.sampler.sample(last, request_ids, positions)
        compat.sampled_tokens_buffer(self, count, tokens.device)[:count] = tokens
        if self.sampler.record_routing and self.routed_model is not None:
            routes = recorded_routes(self.routed_model)  # (padded tokens, L, k)
            if routes is not None:
                fed = context.request_query_lengths[active].tolist()
                self.sampler.keep_routes(split_routes(routes, request_ids, fed))


class _NoTextTokenizer:
    """megatron-core wants a tokenizer to detokenize finished requests; the trainer's inference
    interface detokenizes itself, so this one returns empty text."""

    def __init__(self, eos_id: int) -> None:
        self.eod = eos_id

    def detokenize(self, tokens: list[int], **kwargs) -> str:
        """No text (never used by the trainer)."""
        return ""

    def tokenize(self, text: str, **kwargs) -> list[int]:
        """Text prompts never reach the engine: requests arrive as token ids."""
        raise NotImplementedError("the dynamic engine adapter takes token ids, not text")


class _DetachedLoop:
    """Stands in for the asyncio loop of megatron-core's engine.

    The runner steps the engine directly (``async_forward``/``async_bookkeep``) instead of running
    its serving loop, so the engine's wake-up notifications have nobody to wake: they are closed
    instead of piling up on a loop that never runs. Request futures are plain
    ``concurrent.futures.Future`` objects (only ever resolved, never awaited).
    """

    def call_soon_threadsafe(self, callback: Callable, *args: Any) -> None:
        """Drop the notification (closing a coroutine argument so it never warns)."""
        for arg in args:
            if asyncio.iscoroutine(arg):
                arg.close()

    def create_task(self, coro: Coroutine) -> None:
        """Never schedules anything (see ``call_soon_threadsafe``)."""
        coro.close()

    def create_future(self) -> concurrent.futures.Future:
        """A future megatron-core resolves when a request finishes."""
        return concurrent.futures.Future()


class SteppedDynamicInferenceEngine(DynamicInferenceEngine):
    """megatron-core's ``DynamicInferenceEngine``, stepped by ``DynamicEngineRowRunner``.

    megatron-core 0.18+ marks the whole process as inferring (``InferenceMode``) from the
    engine's construction and every ``resume`` until the next ``suspend``; the model's training
    forward then fails. Here the flag is on only while a step runs (``async_forward``,
    ``async_bookkeep``): the engine leaves it off when built and resumed.
    """

    def __init__(self, controller, context) -> None:
        super().__init__(controller, context, **compat.engine_arguments(DynamicInferenceEngine))
        compat.leave_inference_mode()

    def reset(self) -> None:
        """Reset as megatron-core does, on the detached loop."""
        self._loop = _DetachedLoop()
        super().reset()

    def suspend(self) -> None:
        """Suspend as megatron-core does (frees or offloads the KV cache, by the context's mode)."""
        super().suspend()
        compat.leave_inference_mode()

    def resume(self) -> None:
        """Resume as megatron-core does, then point the controller at the new request metadata
        (``compat.rebind_request_metadata``: 0.16 and 0.17 keep stale references)."""
        was_suspended = compat.is_suspended(self)
        super().resume()
        compat.leave_inference_mode()
        if was_suspended:
            compat.rebind_request_metadata(self.controller, self.context)

    async def async_forward(self):
        """One megatron-core step, in ``InferenceMode``."""
        with compat.inference_mode():
            return await super().async_forward()

    async def async_bookkeep(self, *args, **kwargs):
        """megatron-core's bookkeeping of a step, in ``InferenceMode``."""
        with compat.inference_mode():
            return await super().async_bookkeep(*args, **kwargs)


def build_megatron_engine(
    model: torch.nn.Module,
    config: DynamicEngineConfig,
    vocab_size: int,
    padded_vocab_size: int,
    sampler: SeededSampler,
    pg_collection: Any = None,
) -> SteppedDynamicInferenceEngine:
    """megatron-core's dynamic engine over ``model`` (this rank's shard; CUDA only), on
    ``pg_collection``'s process groups (None: megatron-core's parallel state).

    Installs ``flash_reference`` when neither flash-attn nor FA3 is importable. The KV buffer is
    sized for ``max_requests`` requests of ``max_seq_len`` tokens, so requests are never paused or
    evicted for lack of blocks.
    """
    from megatron.core.transformer import attention
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    if not torch.cuda.is_available():
        raise RuntimeError("megatron-core's DynamicInferenceEngine needs a CUDA device")
    if importlib.util.find_spec("einops") is None or attention.rearrange is None:
        raise RuntimeError("megatron-core's dynamic inference needs einops: pip install einops")
    flash_reference.install_into_megatron_core()
    mc = get_model_config(model)
    tp = tp_size(pg_collection)
    kv_heads = mc.num_query_groups or mc.num_attention_heads
    layers = len(get_attr_wrapped_model(model, "decoder").layers)  # on this pipeline stage
    dtype = mc.params_dtype
    block_bytes = dtype.itemsize * 2 * layers * config.block_size_tokens * kv_heads // tp
    block_bytes *= mc.kv_channels
    blocks = config.max_requests * math.ceil(config.max_seq_len / config.block_size_tokens) + 4
    context = compat.build_context(
        mc,
        num_layers=layers,
        kv_heads=kv_heads,
        params_dtype=dtype,
        max_sequence_length=config.max_seq_len,
        buffer_size_gb=blocks * block_bytes / 1024**3,
        max_requests=config.max_requests,
        max_tokens=config.tokens_per_step(),
        block_size_tokens=config.block_size_tokens,
        kv_cache_mode=config.kv_cache_mode,
        pg_collection=pg_collection,
    )
    wrapped = compat.wrap_model(
        model,
        context,
        hidden_size=mc.hidden_size,
        params_dtype=dtype,
        padded_vocab_size=padded_vocab_size,
        max_requests=config.max_requests,
        max_sequence_length=config.max_seq_len,
        pg_collection=pg_collection,
    )
    wrapped.prep_model_for_inference()
    routed = model if sampler.record_routing else None
    tokenizer = _NoTextTokenizer(config.eos_id)
    controller = SeededSamplingController(wrapped, tokenizer, sampler, routed, pg_collection)
    return SteppedDynamicInferenceEngine(controller, context)


def build_dynamic_step_group(
    model: torch.nn.Module,
    config: DynamicEngineConfig,
    vocab_size: int,
    padded_vocab_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    is_replica_leader: bool = True,
) -> StepGroup:
    """The step group of this rank: megatron-core's engine on its shard of ``model``."""
    runner = dynamic_row_runner(model, config, vocab_size, padded_vocab_size)
    return StepGroup(runner, dp_rank, dp_size, is_replica_leader)


def dynamic_row_runner(
    model: torch.nn.Module,
    config: DynamicEngineConfig,
    vocab_size: int,
    padded_vocab_size: int,
    pg_collection: Any = None,
) -> DynamicEngineRowRunner:
    """The row runner of this rank: megatron-core's engine on its shard of ``model`` (built on
    ``pg_collection``'s groups; None: megatron-core's parallel state)."""
    sampler = SeededSampler(vocab_size)
    if config.record_routing and routing_replays(model):
        start_recording(model)
        sampler.record_routing = True
    engine = build_megatron_engine(
        model, config, vocab_size, padded_vocab_size, sampler, pg_collection
    )
    scoring = model_scoring(model, vocab_size, pg_collection)
    return DynamicEngineRowRunner(engine, sampler, config, scoring)


def tp_size(pg_collection: Any = None) -> int:
    """The tensor-parallel degree of ``pg_collection`` (None: megatron-core's parallel state)."""
    if pg_collection is not None:
        return pg_collection.tp.size()
    return parallel_state.get_tensor_model_parallel_world_size()


def model_scoring(
    model: torch.nn.Module, vocab_size: int, pg_collection: Any = None
) -> ScoringForward | None:
    """Plain forwards of ``model`` over its tensor-parallel group (``pg_collection``'s, else
    megatron-core's; None with pipeline parallelism: a stage is not the whole model)."""
    tp_group = None
    if pg_collection is not None:
        tp_group = pg_collection.tp
    elif parallel_state.model_parallel_is_initialized():
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            return None
        tp_group = parallel_state.get_tensor_model_parallel_group()
    device = next(model.parameters()).device
    return ScoringForward(model, vocab_size, device, tp_group)


def build_dynamic_runner(inputs: RunnerInputs) -> DynamicEngineRowRunner:
    """The ``megatron_core`` backend's provider (``backends.BACKENDS``): megatron-core's engine
    sized for the scheduler's capacity, in the model's dtype (``compute_dtype`` does not apply);
    the tensor-parallel layout is ``inputs.pg_collection``'s, else megatron-core's
    ``parallel_state``."""
    if inputs.padded_vocab_size is None:
        raise ValueError("the megatron_core inference backend needs RunnerInputs.padded_vocab_size")
    config = DynamicEngineConfig(
        max_requests=inputs.config.num_slots,  # the reserved outside slots too
        max_seq_len=inputs.config.max_seq_len,
        eos_id=inputs.config.eos_id,
        record_routing=inputs.config.record_routing,
    )
    return dynamic_row_runner(
        inputs.model, config, inputs.vocab_size, inputs.padded_vocab_size, inputs.pg_collection
    )
