"""The policy's forward, shared by both tiers: a micro-batch's model inputs (packed or not), its
per-token outputs in the unpacked (b, t) layout, and whole-batch results gathered over data
parallelism.

A micro-batch runs either as it is (right-padded rows, positions 0..t-1, causal attention) or,
with a packing capacity, packed (``megatron/rl/grpo/packing.py``: rows of several sequences,
positions restarting at 0, a block-diagonal causal mask). Per-token outputs of a packed forward
are unpacked before anything else reads them, so both layouts give (b, t) tensors aligned with
the micro-batch's targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.chunked_head import DEFAULT_CHUNK_ELEMENTS, chunked_head_outputs
from megatron.rl.grpo.entropy import token_entropy
from megatron.rl.grpo.logprobs import support_logprobs, token_logprobs
from megatron.rl.grpo.packing import PackedLayout, pack_sequences
from megatron.rl.grpo.topk import vocab_parallel_topk
from megatron.rl.models.hidden_states import (
    final_hidden_states,
    output_weight,
    supports_hidden_states,
)
from megatron.rl.models.routing_replay import clear_targets, set_routing_targets
from megatron.trainer.parallel import ParallelContext


@dataclass(frozen=True)
class ModelInputs:
    """What the model is called with for one micro-batch: ``model(ids, positions, mask)``."""

    ids: torch.Tensor
    """(r, s) token ids: the micro-batch's (b, t) inputs, or its packed rows."""
    positions: torch.Tensor
    """(r, s) position of each token in its own sequence."""
    mask: torch.Tensor | None
    """(r, 1, s, s) bool, True = masked out (packed); None: causal."""
    layout: PackedLayout | None
    """Where the packed tokens came from (None: not packed)."""
    width: int
    """t: the micro-batch's width, the width of its per-token outputs."""
    routes: torch.Tensor | None = None
    """(r, s, L * k) int16 the engine's experts at each token, laid out as ``ids`` (-1: none
    recorded); None: the micro-batch has no record."""


@dataclass(frozen=True)
class TokenOutputs:
    """A micro-batch's per-token outputs of one forward, unpacked, differentiable."""

    logprobs: torch.Tensor
    """(b, t) log pi(target) at the rows' sampling temperatures."""
    entropy: torch.Tensor | None = None
    """(b, t) the policy's entropy (None: not asked)."""
    support: torch.Tensor | None = None
    """(b, t, k) log pi of the asked support ids (the distillation teacher's top-k; None: not
    asked)."""


def packed_layout(micro: TrainBatch, capacity: int, shape: tuple[int, int] | None = None):
    """The packing of ``micro``'s rows into rows of ``capacity`` tokens; with ``shape`` (rows,
    width), padded to that fixed shape (pipeline stages exchange activations of one shape)."""
    layout = pack_sequences(micro.lengths, capacity)
    if shape is None:
        return layout
    rows, width = shape
    if rows < layout.num_rows or width < layout.width:
        raise ValueError(f"packed shape {(layout.num_rows, layout.width)} exceeds {shape}")
    return dataclasses.replace(layout, num_rows=rows, width=width)


def model_inputs(
    micro: TrainBatch,
    device: torch.device,
    packing_capacity: int | None = None,
    packed_shape: tuple[int, int] | None = None,
) -> ModelInputs:
    """The model inputs of ``micro`` on ``device``, packed when ``packing_capacity`` is given."""
    width, routes = micro.input_ids.shape[1], micro.routed_experts
    if packing_capacity is None:
        ids = micro.input_ids.to(device)  # (b, t)
        positions = torch.arange(ids.shape[1], device=device)[None, :].expand_as(ids)  # (b, t)
        return ModelInputs(ids, positions, None, None, width, routes)
    layout = packed_layout(micro, packing_capacity, packed_shape)
    ids = layout.pack(micro.input_ids).to(device)  # (r, s)
    mask = layout.attention_mask().to(device)  # (r, 1, s, s)
    packed_routes = None if routes is None else layout.pack(routes, fill=-1)  # (r, s, L * k)
    return ModelInputs(ids, layout.position_ids.to(device), mask, layout, width, packed_routes)


@contextlib.contextmanager
def routes_cleared(model: torch.nn.Module) -> Iterator[None]:
    """Forwards of ``model`` that may be handed routes (``routed_forward``); on exit they are
    forgotten, so that no later forward (the engine's) compares with or replays them."""
    try:
        yield
    finally:
        clear_targets(model)


def routed_forward(model: torch.nn.Module, inputs: ModelInputs) -> None:
    """Hand ``model``'s next forward the engine's routes of ``inputs`` (what the forward does
    with them is the model's routing mode: ``routing_replay.configure_routing``)."""
    set_routing_targets(model, inputs.routes)


def token_outputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool,
    support: torch.Tensor | None = None,
) -> TokenOutputs:
    """(b, t) logprobs of ``targets``, (b, t) entropies and (b, t, k) logprobs of ``support``
    (each when asked) from (b, t, V/tp) logits."""
    logprobs = token_logprobs(logits, targets, vocab_size, temperature, tp_group)
    entropy = token_entropy(logits, vocab_size, temperature, tp_group) if with_entropy else None
    on_support = None
    if support is not None:
        on_support = support_logprobs(logits, support, vocab_size, temperature, tp_group)
    return TokenOutputs(logprobs, entropy, on_support)


def micro_outputs(
    logits: torch.Tensor,
    micro: TrainBatch,
    inputs: ModelInputs,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, t) logprobs of ``micro``'s targets (and (b, t) entropies): ``micro_token_outputs``."""
    out = micro_token_outputs(logits, micro, inputs, vocab_size, tp_group, with_entropy)
    return out.logprobs, out.entropy


def micro_token_outputs(
    logits: torch.Tensor,
    micro: TrainBatch,
    inputs: ModelInputs,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool = False,
    support: torch.Tensor | None = None,
) -> TokenOutputs:
    """The outputs of ``micro`` (``TokenOutputs``; ``support``: (b, t, k) ids) from the
    (r, s, V/tp) logits of ``model(inputs)``, at its sampling temperatures, unpacked."""
    dev, layout = logits.device, inputs.layout
    if layout is None:
        targets, temperature = micro.target_ids.to(dev), micro.temperature.to(dev)
        support = None if support is None else support.to(dev)
        return token_outputs(
            logits, targets, temperature, vocab_size, tp_group, with_entropy, support
        )
    per_token_t = micro.temperature[:, None].expand_as(micro.input_ids)  # (b, t)
    targets = layout.pack(micro.target_ids).to(dev)  # (r, s)
    temperature = layout.pack(per_token_t, fill=1.0).to(dev)  # (r, s)
    support = None if support is None else layout.pack(support).to(dev)  # (r, s, k)
    out = token_outputs(logits, targets, temperature, vocab_size, tp_group, with_entropy, support)
    return unpacked(out, layout, inputs.width)


def unpacked(out: TokenOutputs, layout: PackedLayout, width: int) -> TokenOutputs:
    """``out`` of packed rows in the (b, t) layout of width ``width``."""
    parts = (getattr(out, f.name) for f in dataclasses.fields(out))  # not astuple: no copies
    return TokenOutputs(*(None if x is None else layout.unpack(x, width) for x in parts))


def forward_outputs(
    model: torch.nn.Module,
    micro: TrainBatch,
    inputs: ModelInputs,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, t) logprobs of ``micro``'s targets (and (b, t) entropies): ``forward_token_outputs``."""
    out = forward_token_outputs(
        model, micro, inputs, vocab_size, tp_group, with_entropy, chunk_elements
    )
    return out.logprobs, out.entropy


def forward_token_outputs(
    model: torch.nn.Module,
    micro: TrainBatch,
    inputs: ModelInputs,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    support: torch.Tensor | None = None,
) -> TokenOutputs:
    """The outputs of ``micro`` (``TokenOutputs``; ``support``: (b, t, k) ids) from one forward
    of ``model`` on ``inputs``, differentiable when autograd is on.

    Where the micro-batch's logits (rows x width x V/tp) fit in ``chunk_elements`` they are
    computed whole by the model's output layer (``micro_token_outputs``); above that the model
    runs up to its final norm and the output layer is applied chunk by chunk
    (``megatron/rl/grpo/chunked_head.py``): the same values to float rounding, without holding
    the (tokens, vocab) logits and their softmax for the backward pass.
    """
    rows, width = inputs.ids.shape
    routed_forward(model, inputs)
    weight = output_weight(model) if supports_hidden_states(model) else None
    if weight is None or rows * width * weight.shape[0] <= chunk_elements:
        logits = model(inputs.ids, inputs.positions, inputs.mask)  # (r, s, V/tp)
        return micro_token_outputs(
            logits, micro, inputs, vocab_size, tp_group, with_entropy, support
        )
    hidden = final_hidden_states(model, inputs.ids, inputs.positions, inputs.mask)  # (r, s, H)
    dev, layout = hidden.device, inputs.layout
    per_token_t = micro.temperature[:, None].expand_as(micro.input_ids)  # (b, t)
    if layout is None:
        targets, temperature = micro.target_ids, per_token_t
    else:
        targets, temperature = layout.pack(micro.target_ids), layout.pack(per_token_t, fill=1.0)
        support = None if support is None else layout.pack(support)  # (r, s, k)
    flat = None if support is None else support.reshape(rows * width, -1).to(dev)  # (r * s, k)
    logprobs, entropy, on_support = chunked_head_outputs(
        hidden.reshape(rows * width, -1),
        weight,
        targets.reshape(-1).to(dev),
        temperature.reshape(-1).to(dev),
        vocab_size,
        tp_group,
        with_entropy,
        chunk_elements,
        flat,
    )  # (r * s,), (r * s,), (r * s, k)
    out = TokenOutputs(
        logprobs.view(rows, width),
        None if entropy is None else entropy.view(rows, width),
        None if on_support is None else on_support.view(rows, width, -1),
    )
    return out if layout is None else unpacked(out, layout, inputs.width)


def micro_topk(
    logits: torch.Tensor,
    inputs: ModelInputs,
    k: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t, k) top-k logits (float32, untempered) and their (b, t, k) int64 token ids at every
    input position, i.e. for every next token, in the unpacked layout."""
    values, indices = vocab_parallel_topk(logits, k, vocab_size, tp_group)  # (r, s, k)
    if inputs.layout is None:
        return values, indices
    return inputs.layout.unpack(values, inputs.width), inputs.layout.unpack(indices, inputs.width)


def teacher_micro_outputs(
    logits: torch.Tensor,
    micro: TrainBatch,
    inputs: ModelInputs,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    topk: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """A teacher's (b, t) logprobs of ``micro``'s targets, its (b, t) argmax and, with
    ``topk``, its (b, t, k) top-k logprobs and ids, from the (r, s, V/tp) logits of
    ``teacher(inputs)`` (``micro`` at temperature 1: ``tiers/base.teacher_inputs``)."""
    if topk is None:
        logprobs, _ = micro_outputs(logits, micro, inputs, vocab_size, tp_group)  # (b, t)
        _, top = micro_topk(logits, inputs, 1, vocab_size, tp_group)  # (b, t, 1)
        return logprobs, top[..., 0]
    _, ids = vocab_parallel_topk(logits, topk, vocab_size, tp_group)  # (r, s, k)
    targets = micro.target_ids if inputs.layout is None else inputs.layout.pack(micro.target_ids)
    # the targets' and the top-k's logprobs from one log-softmax, the student's computation of
    # the same ids (``support_logprobs``): a teacher equal to the student gives bitwise equal
    # logprobs, so a zero KL and a zero gradient
    wanted = torch.cat([targets.to(ids.device)[..., None], ids], dim=-1)  # (r, s, 1 + k)
    values = support_logprobs(logits, wanted, vocab_size, None, tp_group)  # (r, s, 1 + k)
    if inputs.layout is not None:
        values = inputs.layout.unpack(values, inputs.width)  # (b, t, 1 + k)
        ids = inputs.layout.unpack(ids, inputs.width)
    return values[..., 0], ids[..., 0], values[..., 1:], ids


def padded_rows(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """(sum b, width, ...) from per-micro-batch (b, t <= width, ...) parts, zero-padded on the
    right (positions past a micro-batch's width hold 0)."""
    padded = []
    for part in parts:
        pad = torch.zeros(
            (part.shape[0], width - part.shape[1], *part.shape[2:]),
            dtype=part.dtype,
            device=part.device,
        )
        padded.append(torch.cat([part, pad], dim=1))
    return torch.cat(padded)


def gather_data_parallel(local: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The whole batch on the CPU from each data-parallel rank's consecutive rows (collective
    over the DP group; on ``ctx.device``, as NCCL needs)."""
    if ctx.dp_size == 1:
        return local.cpu()
    local = local.to(ctx.device).contiguous()
    parts = [torch.empty_like(local) for _ in range(ctx.dp_size)]
    dist.all_gather(parts, local, group=ctx.dp_group)
    return torch.cat(parts).cpu()
