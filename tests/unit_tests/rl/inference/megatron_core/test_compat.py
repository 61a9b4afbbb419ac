"""The megatron-core adapters of ``compat.py`` on the installed release (0.16.1 to 0.19.x) and on
stand-ins of the other API shapes, so each branch is checked whatever is installed."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.rl.inference.megatron_core import compat


def test_recompute_and_persist_are_offered_everywhere_and_unknown_modes_refused():
    assert {"recompute", "persist"} <= set(compat.KV_CACHE_MODES)
    assert compat.suspends("recompute") and compat.suspends("offload")
    assert not compat.suspends("persist")
    with pytest.raises(ValueError, match="'keep' is not offered"):
        compat.kv_cache_mode_of("keep")


def test_kv_cache_modes_are_megatron_cores_where_it_has_them():
    try:
        from megatron.core.inference.config import KVCacheManagementMode
    except ImportError:  # 0.16: no such enum, suspend frees the KV
        assert compat.KV_CACHE_MODES == ("recompute", "persist")
        assert compat.kv_cache_mode_of("recompute") is None
        return
    assert "offload" in compat.KV_CACHE_MODES
    assert compat.kv_cache_mode_of("persist") is KVCacheManagementMode.PERSIST


def test_engine_arguments_follow_the_constructor():
    class Old:
        def __init__(self, controller, context, random_seed=None, enable_chunked_prefill=True):
            pass

    class New:
        def __init__(self, controller, context):
            pass

    assert compat.engine_arguments(Old) == {"random_seed": 0, "enable_chunked_prefill": False}
    assert compat.engine_arguments(New) == {}


def test_suspended_state_of_a_flag_and_of_an_enum():
    assert compat.is_suspended(types.SimpleNamespace(is_suspended=True))
    state = types.SimpleNamespace
    assert compat.is_suspended(state(state=state(name="SUSPENDED")))
    assert not compat.is_suspended(state(state=state(name="RUNNING")))


def test_last_token_logits_setting_on_the_context_or_its_config():
    assert compat.only_last_token_logits(
        types.SimpleNamespace(materialize_only_last_token_logits=1)
    )
    config = types.SimpleNamespace(materialize_only_last_token_logits=False)
    assert not compat.only_last_token_logits(types.SimpleNamespace(config=config))


def test_step_logits_and_the_token_buffer_of_both_hooks():
    logits = torch.zeros(1, 3, 5)
    controller = types.SimpleNamespace(
        _all_logits_cuda=logits,
        _sampled_tokens_cuda=None,  # 0.18.2
        inference_wrapped_model=types.SimpleNamespace(
            inference_context=types.SimpleNamespace(max_requests=4)
        ),
    )
    assert compat.step_logits(controller, None) is logits  # 0.18+: no argument
    given = torch.ones(1, 2, 5)
    assert compat.step_logits(controller, given) is given  # 0.16, 0.17
    buffer = compat.sampled_tokens_buffer(controller, 3, torch.device("cpu"))
    assert buffer.shape == (4,) and controller._sampled_tokens_cuda is buffer
    assert compat.sampled_tokens_buffer(controller, 2, torch.device("cpu")) is buffer


def test_request_metadata_is_rebound_where_the_controller_keeps_references():
    fresh = {"termination_id": torch.ones(2), "top_k": torch.ones(2)}
    context = types.SimpleNamespace(
        request_metadata=fresh,
        request_metadata_types=[
            ("termination_id", torch.int64, True),
            ("top_k", torch.int32, False),
        ],
    )
    stale = {"termination_id": torch.zeros(2), "top_k": torch.zeros(2)}
    controller = types.SimpleNamespace(_request_metadata=stale)
    compat.rebind_request_metadata(controller, context)
    assert stale["termination_id"] is fresh["termination_id"]  # on the GPU: rebound
    assert stale["top_k"] is not fresh["top_k"]  # pinned host copies stay the controller's
    compat.rebind_request_metadata(types.SimpleNamespace(), context)  # 0.18+: nothing to do


def test_inference_mode_is_on_only_inside_a_step():
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        InferenceMode = None
    if InferenceMode is None:  # 0.16, 0.17: no flag, the scope is a no-op
        with compat.inference_mode():
            pass
        compat.leave_inference_mode()
        return
    InferenceMode.set_active()  # as megatron-core's engine constructor leaves it
    compat.leave_inference_mode()
    assert not InferenceMode.is_active()
    with compat.inference_mode():
        assert InferenceMode.is_active()
    assert not InferenceMode.is_active()
