"""The CPU tier's row runner: the trained model with a per-slot KV cache, and seeded sampling.

A ``KVCacheRowRunner`` owns the KV cache of its data-parallel replica. It runs on every rank of the
replica's tensor-parallel group: the forward is collective over that group, the vocab-parallel
logits are gathered, and every TP rank draws the same uniforms, so no broadcast of tokens is
needed inside a replica. The uniform of a request's token at position p is a pure function of
(request seed, p) (``token_uniform``): no RNG state lives in the runner, and a token never
depends on which requests share its batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.rl.inference.protocol import RowResult, RowWork
from megatron.rl.inference.sampling import sample_tokens, token_uniform
from megatron.rl.models.cached_forward import CachedForward
from megatron.rl.models.kv_cache import KVCache


class KVCacheRowRunner:
    """Executes rows on the local model replica and samples their next tokens
    (``protocol.RowRunner``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        vocab_size: int,
        tp_group: dist.ProcessGroup | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.device = cache.keys.device
        self.compute_dtype = compute_dtype
        """bfloat16: the forward runs under ``torch.autocast`` as training does with ``--bf16``
        (None: in the weights' dtype)."""
        # The model's computation as one plain program (same values, a fraction of the Python
        # overhead); None for models it does not reproduce, which run their own forward.
        self.cached_forward = CachedForward.of(model, tp_group, compute_dtype)

    @torch.no_grad()
    def run(self, rows: list[RowWork]) -> list[RowResult]:
        """Feed ``rows`` through the model and sample one token for each, in row order.

        The model runs in whatever mode it is in: the owner of the generation window puts it in
        eval mode for the window (not per step: toggling every module costs ~0.25 ms a step).
        """
        if not rows:
            return []
        if self.cached_forward is not None:  # packed tokens: one pass for every kind of row
            return self._sample(rows, self._forward_last_logits(rows))
        # Decode rows (one token) and prefill rows (many) go in separate forwards so that
        # single-token rows are not padded to the longest prompt.
        decode = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        prefill = [i for i, r in enumerate(rows) if len(r.tokens) > 1]
        parts = [self._forward_last_logits([rows[i] for i in b]) for b in (decode, prefill) if b]
        if len(parts) == 1:  # one kind of row: already in row order
            logits = parts[0]  # (B, V)
        else:
            logits = torch.cat(parts)[torch.argsort(torch.tensor(decode + prefill))]  # (B, V)
        return self._sample(rows, logits)

    def end_window(self, idle: bool = False) -> None:
        """The weights may change before the next window, so the forward's copies of them are
        dropped. The KV cache stays valid across windows for the requests in flight; when none
        is (``idle``: always at forced lag 0) its memory is released until the next window."""
        if self.cached_forward is not None:
            self.cached_forward.transposed.clear()
        if idle:
            self.cache.release()

    def _forward_last_logits(self, rows: list[RowWork]) -> torch.Tensor:
        """Full-vocabulary logits at each row's last new token: (B, V_padded) float32."""
        width = max(len(r.tokens) for r in rows)
        ids = torch.tensor([r.tokens + (0,) * (width - len(r.tokens)) for r in rows])  # (B, T)
        starts = torch.tensor([r.start for r in rows])
        lengths = torch.tensor([len(r.tokens) for r in rows])
        positions = starts[:, None] + torch.arange(width)[None, :]  # (B, T)
        positions = positions.clamp(max=self.cache.max_seq_len - 1)  # padding stays in range
        slots = torch.tensor([r.slot for r in rows])
        dev = self.device
        autocast = torch.autocast(dev.type, self.compute_dtype or torch.bfloat16,
                                  enabled=self.compute_dtype is not None)  # fmt: skip
        with self.cache.step(slots.to(dev), starts.to(dev), lengths.to(dev)) as step, autocast:
            if self.cached_forward is not None:
                logits = self.cached_forward(ids.to(dev), positions.to(dev), step)  # (B, V/tp)
            else:
                out = self.model(ids.to(dev), positions.to(dev), None)  # (B, T, V/tp)
                logits = out[torch.arange(len(rows), device=dev), (lengths - 1).to(dev)]
        return self._gather_vocab(logits.float())

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V/tp) vocab-parallel logits -> (B, V_padded), padding ids masked to -inf."""
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        logits[:, self.vocab_size :] = float("-inf")
        return logits.cpu()

    def _sample(self, rows: list[RowWork], logits: torch.Tensor) -> list[RowResult]:
        uniforms = torch.tensor([token_uniform(r.seed, r.start + len(r.tokens)) for r in rows])
        tokens, logprobs = sample_tokens(
            logits,
            temperature=torch.tensor([r.temperature for r in rows]),
            top_p=torch.tensor([r.top_p for r in rows]),
            top_k=torch.tensor([r.top_k for r in rows]),
            uniforms=uniforms,
        )
        return [
            RowResult(slot=r.slot, token=int(t), logprob=float(lp))
            for r, t, lp in zip(rows, tokens.tolist(), logprobs.tolist())
        ]
