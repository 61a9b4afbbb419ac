"""A GPTModel's forward up to (not including) its output layer, and the output layer's weight.

``final_hidden_states(model, ids, positions, mask)`` runs what megatron-core's
``GPTModel.forward`` runs before ``_postprocess``: the embedding and position preprocessing
(``_preprocess``: RoPE tables at each row's positions for ``RoPEGPTModel``), then the decoder with
its final norm. The caller applies the output layer itself (``megatron/rl/grpo/chunked_head.py``
does it chunk by chunk, so the (tokens, vocab) logits never exist whole). Models that compute
more than an output layer in ``_postprocess`` (multi-token prediction) or that are not the last
pipeline stage are refused.
"""

from __future__ import annotations

import torch


def supports_hidden_states(model: torch.nn.Module) -> bool:
    """Whether ``final_hidden_states`` reproduces ``model``'s forward up to its output layer."""
    config = getattr(model, "config", None)
    return (
        config is not None
        and hasattr(model, "_preprocess")
        and hasattr(model, "decoder")
        and getattr(model, "post_process", False)
        and getattr(model, "pre_process", False)
        and not getattr(model, "mtp_process", False)
        and getattr(config, "mtp_num_layers", None) is None
        and not getattr(config, "sequence_parallel", False)
        and not getattr(config, "fine_grained_activation_offloading", False)
    )


def final_hidden_states(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """(b, s, H) hidden states after the final norm of ``model(ids, positions, mask)``.

    ``ids``/``positions``: (b, s); ``mask``: megatron-core's boolean attention mask or None
    (causal).
    """
    pre = model._preprocess(input_ids=ids, position_ids=positions)
    decoder_input, rotary, cos, sin, offset, padding = pre[:6]
    hidden = model.decoder(
        hidden_states=decoder_input,
        attention_mask=mask,
        rotary_pos_emb=rotary,
        rotary_pos_cos=cos,
        rotary_pos_sin=sin,
        rotary_pos_cos_sin=pre[6] if len(pre) == 7 else None,
        sequence_len_offset=offset,
        padding_mask=padding,
    )  # (s, b, H)
    return hidden.transpose(0, 1)


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The (V/tp, H) weight of ``model``'s output layer (the embedding's when they are tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
