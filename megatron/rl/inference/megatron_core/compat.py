"""megatron-core's dynamic-inference API across the supported releases (0.16.1 to 0.19.x).

The rest of the backend (``dynamic_engine.py``, ``dynamic_runner.py``) calls these adapters and
never looks at a version number: each adapter detects the API it needs from what the installed
megatron-core has (a module that imports, a parameter in a signature, an attribute), once, at
import. One adapter per API that changed:

| adapter | detects | 0.16.1 | 0.17 and later |
| --- | --- | --- | --- |
| ``build_context`` | ``megatron.core.inference.config.InferenceConfig`` imports | keyword arguments | ``DynamicInferenceContext(model_config, InferenceConfig(...))`` |
| ``KV_CACHE_MODES``, ``kv_cache_mode_of`` | ``InferenceConfig.kv_cache_management_mode`` | ``recompute`` (``suspend`` frees the KV) and ``persist`` (never suspended) | megatron-core's ``KVCacheManagementMode``: also ``offload`` |
| ``build_context(pg_collection=)`` | the same | an argument of the context | a field of ``InferenceConfig`` |
| ``wrap_model`` | ``...model_inference_wrappers.inference_wrapper_config`` imports | ``GPTInferenceWrapper(model, InferenceWrapperConfig, context, pg_collection)`` | ``GPTInferenceWrapper(model, context)`` (the groups from the context) |
| ``controller_arguments`` | ``pp_group`` among ``TextGenerationController.__init__``'s parameters | the pipeline group is an argument (None: the parallel state's) | read from the context's ``pg_collection`` |
| ``engine_arguments`` | parameters of ``DynamicInferenceEngine.__init__`` | ``random_seed``, ``enable_chunked_prefill`` | neither (chunked prefill is in ``InferenceConfig``) |
| ``is_suspended`` | ``engine.is_suspended`` or ``engine.state`` | the flag | the ``EngineState`` enum |
| ``step_logits``, ``sampled_tokens_buffer`` | ``_dynamic_step_sample_logits``' parameters; ``_sampled_tokens_cuda`` | the logits are the argument; the buffer is preallocated | 0.18+: the logits are in ``_all_logits_cuda``, the buffer may be None (0.18.2) |
| ``only_last_token_logits`` | ``context.config`` | ``context.materialize_only_last_token_logits`` | ``context.config.materialize_only_last_token_logits`` |
| ``rebind_request_metadata`` | ``controller._request_metadata`` | the controller's stale metadata after ``resume`` (fixed here) | 0.17: the same; 0.18+: gone (nothing to do) |
| ``inference_mode``, ``leave_inference_mode`` | ``megatron.core.inference.utils.InferenceMode`` | absent (no-ops) | 0.18+: the process-wide flag the engine sets; scoped here to engine steps |

Importing this module imports megatron-core's inference package (not its engine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch


def _optional(module: str, name: str) -> Any:
    """``module.name``, or None where this megatron-core lacks the module or the name."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


_InferenceConfig = _optional("megatron.core.inference.config", "InferenceConfig")
_KVCacheManagementMode = _optional("megatron.core.inference.config", "KVCacheManagementMode")
_InferenceWrapperConfig = _optional(
    "megatron.core.inference.model_inference_wrappers.inference_wrapper_config",
    "InferenceWrapperConfig",
)
_InferenceMode = _optional("megatron.core.inference.utils", "InferenceMode")

# ----------------------------------------------------------------------------- KV-cache modes

RECOMPUTE, PERSIST, OFFLOAD = "recompute", "persist", "offload"
"""What a generation window's end does with megatron-core's KV cache while the trainer trains:

* ``recompute``: free it (``suspend``); at the next window the requests in flight are prefilled
  again under the new weights. Frees the most memory; the tokens after a window boundary are
  computed from the new weights only.
* ``persist``: keep it on the GPU (the engine is not suspended); the requests in flight continue
  on keys and values computed by the old weights.
* ``offload``: copy it to host memory and back (megatron-core 0.17+); ``persist``'s tokens with
  ``recompute``'s GPU memory during training.
"""


def _modes() -> tuple[str, ...]:
    if _KVCacheManagementMode is None:  # 0.16: suspend frees the KV, and nothing else exists
        return (RECOMPUTE, PERSIST)
    return tuple(m.value for m in _KVCacheManagementMode)


KV_CACHE_MODES: tuple[str, ...] = _modes()
"""The KV-cache modes this megatron-core offers (``recompute`` and ``persist`` everywhere)."""


def kv_cache_mode_of(mode: str) -> Any:
    """megatron-core's ``KVCacheManagementMode`` of ``mode`` (None where it has none); raises
    ``ValueError`` for a mode this megatron-core does not offer."""
    if mode not in KV_CACHE_MODES:
        raise ValueError(
            f"KV-cache mode {mode!r} is not offered by this megatron-core (offered: "
            f"{', '.join(KV_CACHE_MODES)})"
        )
    return None if _KVCacheManagementMode is None else _KVCacheManagementMode(mode)


def suspends(mode: str) -> bool:
    """Whether windows end with megatron-core's ``suspend`` in ``mode`` (all but ``persist``)."""
    return mode != PERSIST


# ----------------------------------------------------------------------------- construction


def build_context(
    model_config: Any,
    *,
    num_layers: int,
    kv_heads: int,
    params_dtype: torch.dtype,
    max_sequence_length: int,
    buffer_size_gb: float,
    max_requests: int,
    max_tokens: int,
    block_size_tokens: int,
    kv_cache_mode: str,
    pg_collection: Any = None,
) -> Any:
    """megatron-core's ``DynamicInferenceContext`` (paged KV cache, no chunked prefill, logits of
    each request's last token only, no flashinfer RoPE, no unified memory); ``pg_collection``:
    the model's process groups when they are not megatron-core's parallel state."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    common = dict(
        max_sequence_length=max_sequence_length,
        buffer_size_gb=buffer_size_gb,
        max_requests=max_requests,
        max_tokens=max_tokens,
        block_size_tokens=block_size_tokens,
        materialize_only_last_token_logits=True,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
    )
    if pg_collection is not None:  # 0.16: an argument; 0.17+: a field of InferenceConfig
        fields = () if _InferenceConfig is None else dataclasses.fields(_InferenceConfig)
        if _InferenceConfig is not None and "pg_collection" not in {f.name for f in fields}:
            raise RuntimeError(
                "this megatron-core's InferenceConfig has no pg_collection: an inference copy "
                "on a layout of its own needs 0.16.1 or a release whose InferenceConfig has it"
            )
        common["pg_collection"] = pg_collection
    management = kv_cache_mode_of(kv_cache_mode)
    if _InferenceConfig is None:  # 0.16: the dimensions are arguments
        return DynamicInferenceContext(
            params_dtype=params_dtype,
            num_layers=num_layers,
            kv_channels=model_config.kv_channels,
            num_attention_heads=kv_heads,
            **common,
        )
    fields = {f.name for f in dataclasses.fields(_InferenceConfig)}
    if "enable_chunked_prefill" in fields:
        common["enable_chunked_prefill"] = False
    if management is not None:
        common["kv_cache_management_mode"] = management
    # 0.17+: the dimensions (layers of this pipeline stage, KV heads, dtype) come from the model
    return DynamicInferenceContext(model_config, _InferenceConfig(**common))


def wrap_model(
    model: torch.nn.Module,
    context: Any,
    *,
    hidden_size: int,
    params_dtype: torch.dtype,
    padded_vocab_size: int,
    max_requests: int,
    max_sequence_length: int,
    pg_collection: Any = None,
) -> Any:
    """megatron-core's ``GPTInferenceWrapper`` of ``model`` over ``context`` (on
    ``pg_collection``'s groups where given; 0.17+ reads them from the context)."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )

    if _InferenceWrapperConfig is None:  # 0.17+: the wrapper reads the model and the context
        return GPTInferenceWrapper(model, context)
    config = _InferenceWrapperConfig(
        hidden_size=hidden_size,
        params_dtype=params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=padded_vocab_size,
        inference_max_requests=max_requests,
        inference_max_seq_length=max_sequence_length,
    )
    return GPTInferenceWrapper(model, config, context, pg_collection)


def controller_arguments(controller_class: type, pg_collection: Any = None) -> dict[str, Any]:
    """The keyword arguments of ``controller_class`` (a ``TextGenerationController``) for
    ``pg_collection``'s pipeline group: an inference copy is one stage whatever the training's
    (0.16: ``pp_group``; 0.17+ reads it from the context's ``pg_collection``)."""
    params = inspect.signature(controller_class.__init__).parameters
    if pg_collection is None or "pp_group" not in params:
        return {}
    return {"pp_group": pg_collection.pp}


def engine_arguments(engine_class: type) -> dict[str, Any]:
    """Keyword arguments of ``engine_class(controller, context, ...)`` that this megatron-core
    still takes: a fixed seed (unused: the trainer samples itself) and no chunked prefill."""
    parameters = inspect.signature(engine_class.__init__).parameters
    wanted = {"random_seed": 0, "enable_chunked_prefill": False}
    return {name: value for name, value in wanted.items() if name in parameters}


# ----------------------------------------------------------------------------- engine state


def is_suspended(engine: Any) -> bool:
    """Whether megatron-core's engine is suspended (0.16: a flag; 0.17+: ``EngineState``)."""
    if hasattr(engine, "is_suspended"):
        return bool(engine.is_suspended)
    return engine.state.name in ("SUSPENDED", "SUSPENDING")


def rebind_request_metadata(controller: Any, context: Any) -> None:
    """Point the controller at the context's request metadata after a ``resume``.

    megatron-core 0.16 and 0.17 reallocate the context's request-metadata tensors when the engine
    resumes, but the controller keeps references to the GPU-resident ones it bound at
    construction (``termination_id``): it would compare sampled tokens against the freed tensors'
    stale or never-written values and finish requests on arbitrary tokens. 0.18+ reads the
    context's metadata directly (no ``_request_metadata``): nothing to do.
    """
    metadata = getattr(controller, "_request_metadata", None)
    if metadata is None:
        return
    for label, *_, on_gpu in context.request_metadata_types:
        if on_gpu:
            metadata[label] = context.request_metadata[label]


# ----------------------------------------------------------------------------- sampling hook


def only_last_token_logits(context: Any) -> bool:
    """Whether the forward materialized only each request's last-token logits."""
    config = getattr(context, "config", None)
    if config is not None and hasattr(config, "materialize_only_last_token_logits"):
        return bool(config.materialize_only_last_token_logits)
    return bool(context.materialize_only_last_token_logits)


def step_logits(controller: Any, logits: torch.Tensor | None) -> torch.Tensor:
    """The logits of the step being sampled: the hook's argument (0.16, 0.17), else the
    controller's ``_all_logits_cuda`` (0.18+, where the hook takes none)."""
    return controller._all_logits_cuda if logits is None else logits


def sampled_tokens_buffer(controller: Any, count: int, device: torch.device) -> torch.Tensor:
    """The controller's token buffer with room for ``count`` tokens (0.18.2 starts it as None and
    rebinds it to each step's sampling output; elsewhere it is preallocated)."""
    buffer = getattr(controller, "_sampled_tokens_cuda", None)
    if buffer is None or buffer.numel() < count:
        size = max(count, controller.inference_wrapped_model.inference_context.max_requests)
        buffer = torch.empty(size, dtype=torch.int64, device=device)
        controller._sampled_tokens_cuda = buffer
    return buffer


# ----------------------------------------------------------------------------- inference mode


@contextlib.contextmanager
def inference_mode() -> Iterator[None]:
    """megatron-core's process-wide ``InferenceMode`` for the duration of one engine step (a no-op
    where it does not exist). Outside engine steps it must be off: the model's training forward
    asserts on it (``Inference must always gather TP logits``)."""
    if _InferenceMode is None:
        yield
        return
    with _InferenceMode.active():
        yield


def leave_inference_mode() -> None:
    """Clear the ``InferenceMode`` flag megatron-core's engine sets when it is built and resumed
    (0.18+; a no-op elsewhere)."""
    if _InferenceMode is not None:
        _InferenceMode.unset_active()
