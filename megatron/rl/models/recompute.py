"""Full activation recompute of a GPTModel's transformer layers, without CUDA.

megatron-core's own recompute (``recompute_granularity="full"``) saves and restores the CUDA RNG
state around each recomputed block (``tensor_parallel.checkpoint``), so it cannot run on a CPU
build of torch. ``recompute_layers(model)`` does the same job with torch's non-reentrant
``torch.utils.checkpoint``: each layer's forward keeps only its inputs, and the backward pass runs
the layer again (under the autocast state of the forward) to get what its gradient needs. The
layers here have no dropout (``hidden_dropout`` and ``attention_dropout`` are 0), so the recomputed
activations equal the first ones without any RNG bookkeeping. Without autograd (the engine,
``torch.no_grad``) a layer runs as it is.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint


def recompute_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Make every layer of ``model.decoder`` recompute its activations in the backward pass;
    returns ``model``. Refuses a model with dropout (its recomputation would not be exact)."""
    config = model.config
    if config.hidden_dropout or config.attention_dropout:
        raise ValueError("activation recompute needs hidden_dropout = attention_dropout = 0")
    for layer in model.decoder.layers:
        layer.forward = _recomputed(layer.forward)
    return model


def _recomputed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
