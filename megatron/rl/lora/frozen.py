"""The frozen base's linear weights stored the way the CPU tier's products read them."""

from __future__ import annotations

import torch
from megatron.core.utils import unwrap_model


def store_frozen_linear_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Store the frozen weights of ``model``'s linear layers for products ``x @ W^T``: as the
    contiguous (in, out) transpose (the parameter stays the (out, in) view of it), and in
    ``dtype`` when given. Returns the number of parameters stored so.

    The CPU tier does this with LoRA. The transposed layout is the one a row-major GEMM reads
    fastest, so the CPU engine takes these weights as they are instead of keeping a transposed
    copy of each during a generation window (``TransposedWeights``). ``dtype`` bfloat16 is
    ``--bf16``: every product of those weights runs in bfloat16 under autocast, which casts a
    float32 weight to exactly the values stored here, so nothing computed changes and half the
    memory goes. Biases, norms, the embedding (and an output layer tied to it) keep their
    layout and dtype."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    gpt = unwrap_model(model)
    shared = None
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        shared = gpt.shared_embedding_or_output_weight()
    stored = 0
    for module in gpt.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or weight is None:
            continue
        if weight is shared or weight.requires_grad or weight.dim() != 2:
            continue
        weight.data = weight.data.to(dtype or weight.dtype).t().contiguous().t()
        stored += weight.numel()
    return stored
