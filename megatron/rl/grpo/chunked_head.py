r"""Token logprobs and entropies straight from the final hidden states, chunked over the tokens.

The output layer of a real vocabulary is the largest activation of a training step: at
SmolLM2-135M's 49152 ids, one micro-batch of 8 x 128 tokens has 201 MB of float32 logits, and
``log_softmax`` over them keeps several such tensors alive until the backward pass (the float
copy, the tempered copy, the masked copy, the log-softmax saved for its gradient). As fused
linear-cross-entropy kernels do, ``chunked_token_outputs`` never holds (tokens, vocab) at once:

* forward, per chunk of c tokens: z = (h W^T) / T (c, V/tp) in float32, padded ids masked to
  -inf, lse = log sum exp z (over the vocab-parallel ranks: their max and sum all-reduced), the
  target's logprob z[y] - lse and, if asked, the entropy H = lse - sum p z; only (N,) vectors
  are kept.
* backward, per chunk: z and p = exp(z - lse) recomputed from the saved hidden states, then
  dL/dz = g_lp (onehot(y) - p) - g_H p (log p + H) + sum_j g_j (onehot(s_j) - p), divided by T;
  dL/dh = dL/dz W (all-reduced
  over tensor parallelism, as megatron-core's column-parallel input copy does) and, unless the
  output layer is frozen (LoRA), dL/dW += dL/dz^T h.

So the peak of the head is a few (c, V/tp) float32 tensors instead of several (N, V/tp). Under
``torch.autocast`` the products run in the autocast dtype (bfloat16 on the CPU tier's ``--bf16``),
exactly as the output layer's matmul would (operands rounded to bfloat16, float32 accumulation),
and the softmax in float32; the weight and the hidden states are rounded once per call, not once
per chunk and product (at 49152 x 576 that cast cost more than the products: 38% of a training
update of SmolLM2-135M, profiled).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK_ELEMENTS = 1 << 23
"""Logit elements per chunk (tokens x vocab shard): 32 MiB of float32."""


def chunked_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N,) log p(target) and (N,) entropies (or None) of softmax((hidden @ weight^T) / T)
    (``chunked_head_outputs`` without a support)."""
    logprobs, entropy, _ = chunked_head_outputs(
        hidden, weight, targets, temperature, vocab_size, tp_group, with_entropy, chunk_elements
    )
    return logprobs, entropy


def chunked_head_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    support: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(N,) log p(target), (N,) entropies (or None) and (N, k) log p of ``support`` (or None)
    under softmax((hidden @ weight^T) / T).

    Args:
        hidden: (N, H) final hidden states (after the final norm), one row per token.
        weight: (V/tp, H) this rank's rows of the output layer (vocab-parallel).
        targets: (N,) int64 token ids.
        temperature: (N,) per-token sampling temperature (<= 0: greedy, treated as 1).
        vocab_size: real vocabulary size; ids >= vocab_size get probability 0.
        tp_group: the group the vocabulary is split over (None or size 1: not split).
        with_entropy: also return the entropies.
        chunk_elements: at most this many logits (tokens x V/tp) exist at once.
        support: (N, k) int64 ids (< ``vocab_size``) whose logprobs are also wanted.

    Returns:
        float32 (N,) logprobs, (N,) entropies and (N, k) support logprobs, differentiable
        w.r.t. ``hidden`` and ``weight``.
    """
    t = temperature.float()
    inv_temp = torch.where(t > 0, 1.0 / t, torch.ones_like(t))  # (N,)
    chunk = max(1, chunk_elements // max(weight.shape[0], 1))
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else None
    ids = targets.new_zeros((targets.shape[0], 0)) if support is None else support  # (N, k)
    logprobs, entropy, on_support = _ChunkedHead.apply(
        hidden, weight, targets, inv_temp, ids, vocab_size, tp_group, with_entropy, chunk, dtype
    )
    return (
        logprobs,
        entropy if with_entropy else None,
        on_support if support is not None else None,
    )


class _ChunkedHead(torch.autograd.Function):
    """The forward and backward of ``chunked_token_outputs`` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        inv_temp,
        support,
        vocab_size,
        tp_group,
        with_entropy,
        chunk,
        dtype,
    ):
        head = _Head(weight, vocab_size, tp_group, dtype)
        n, operands = hidden.shape[0], head.operand(hidden)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.zeros_like(logprobs)
        on_support = torch.empty(support.shape, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = head.logits(operands[s:e], inv_temp[s:e])  # (c, V/tp) float32
            lse[s:e] = head.logsumexp(z)
            logprobs[s:e] = head.target_logits(z, targets[s:e]) - lse[s:e]
            if with_entropy:
                p = torch.exp(z - lse[s:e, None])
                entropy[s:e] = lse[s:e] - head.all_reduce(head.finite(z).mul_(p).sum(-1))
            if support.shape[1]:
                on_support[s:e] = head.target_logits(z, support[s:e]) - lse[s:e, None]
        ctx.save_for_backward(hidden, weight, targets, inv_temp, support, lse, entropy)
        ctx.settings = (vocab_size, tp_group, with_entropy, chunk, dtype)
        return logprobs, entropy, on_support

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, grad_support):
        hidden, weight, targets, inv_temp, support, lse, entropy = ctx.saved_tensors
        vocab_size, tp_group, with_entropy, chunk, dtype = ctx.settings
        head = _Head(weight, vocab_size, tp_group, dtype)
        operands = head.operand(hidden)
        grad_hidden = torch.empty_like(hidden)
        wants_weight = ctx.needs_input_grad[1]  # a frozen output layer (LoRA) needs no dL/dW
        grad_weight = None
        if wants_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        g_lp = grad_logprobs.float() if grad_logprobs is not None else None
        g_h = grad_entropy.float() if with_entropy and grad_entropy is not None else None
        g_s = grad_support.float() if support.shape[1] and grad_support is not None else None
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            z = head.logits(operands[s:e], inv_temp[s:e])  # (c, V/tp)
            p = torch.exp(z - lse[s:e, None])  # (c, V/tp)
            grad_z = torch.zeros_like(z)
            g_lse = None  # (c,) what every logprob's -lse passes back: -p times its sum
            if g_lp is not None:
                g_lse = g_lp[s:e].clone()
                head.add_at_targets(grad_z, targets[s:e], g_lp[s:e])
            if g_s is not None:  # d(z[s_j] - lse)/dz = onehot(s_j) - p
                g_sum = g_s[s:e].sum(-1)
                g_lse = g_sum if g_lse is None else g_lse.add_(g_sum)
                head.add_at_targets(grad_z, support[s:e], g_s[s:e])
            if g_lse is not None:
                grad_z.sub_(p * g_lse[:, None])
            if g_h is not None:  # dH/dz = -p (log p + H)
                log_p = head.finite(z - lse[s:e, None])
                grad_z.sub_(p * (log_p + entropy[s:e, None]) * g_h[s:e, None])
            grad_z.mul_(inv_temp[s:e, None])
            g_hidden, g_weight = head.backward(grad_z, operands[s:e], wants_weight)
            grad_hidden[s:e] = g_hidden  # cast to the hidden states' dtype
            if wants_weight:
                grad_weight += g_weight
        if head.tp_size > 1:
            dist.all_reduce(grad_hidden, group=tp_group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


class _Head:
    """One rank's slice of the output layer: logits of a chunk and their vocab-parallel sums."""

    def __init__(self, weight, vocab_size, tp_group, dtype) -> None:
        self.weight = weight if dtype is None else weight.detach().to(dtype)  # rounded once
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        part = weight.shape[0]
        self.first = (dist.get_rank(tp_group) if self.tp_size > 1 else 0) * part
        ids = torch.arange(self.first, self.first + part, device=weight.device)
        self.padded = ids >= vocab_size  # (V/tp,)
        self.any_padded = bool(self.padded.any())
        self.dtype = dtype

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the products' dtype (the autocast dtype, else unchanged)."""
        return x if self.dtype is None else x.to(self.dtype)

    def logits(self, hidden: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
        """(c, V/tp) float32 tempered logits of a chunk (``hidden`` already an operand),
        padded ids at -inf."""
        with torch.autocast(self.weight.device.type, enabled=False):
            z = torch.matmul(hidden, self.weight.t())
        z = z.float().mul_(inv_temp[:, None])
        if self.any_padded:
            z.masked_fill_(self.padded, float("-inf"))
        return z

    def finite(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` with the padded ids' -inf replaced by 0 (their probability is 0)."""
        return z.masked_fill(self.padded, 0.0) if self.any_padded else z.clone()

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``x`` reduced over the vocab-parallel ranks (itself without TP)."""
        if self.tp_size > 1:
            dist.all_reduce(x, op=op, group=self.tp_group)
        return x

    def logsumexp(self, z: torch.Tensor) -> torch.Tensor:
        """(c,) log sum exp over the whole (vocab-parallel) vocabulary."""
        top = self.all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX)  # (c,)
        total = self.all_reduce(torch.exp(z - top[:, None]).sum(-1))
        return top + torch.log(total)

    def _local(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c, k) local column of each (c,) target or (c, k) support id, and whether this rank
        holds it."""
        local = (targets if targets.dim() == 2 else targets[:, None]) - self.first
        held = (local >= 0) & (local < self.weight.shape[0])
        return local.clamp(0, self.weight.shape[0] - 1), held

    def target_logits(self, z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(c,) z[target] (or (c, k) of (c, k) ids), from the rank that holds each column."""
        local, held = self._local(targets)
        picked = z.gather(-1, local)  # (c, k)
        picked = self.all_reduce(torch.where(held, picked, torch.zeros_like(picked)))
        return picked if targets.dim() == 2 else picked.squeeze(-1)

    def add_at_targets(self, grad_z: torch.Tensor, targets: torch.Tensor, g: torch.Tensor) -> None:
        """grad_z[i, target_i] += g_i (or at each of (c, k) ids) where this rank holds it."""
        local, held = self._local(targets)
        g = g if g.dim() == 2 else g[:, None]
        grad_z.scatter_add_(-1, local, torch.where(held, g, torch.zeros_like(g)))

    def backward(self, grad_z: torch.Tensor, hidden: torch.Tensor, weight_grad: bool = True):
        """(dL/dh (c, H), dL/dW (V/tp, H) float32, or None without ``weight_grad``) of one
        chunk (``hidden`` an operand)."""
        grad_z = self.operand(grad_z)
        with torch.autocast(self.weight.device.type, enabled=False):
            g_hidden = torch.matmul(grad_z, self.weight)
            g_weight = torch.matmul(grad_z.t(), hidden).float() if weight_grad else None
        return g_hidden, g_weight
