"""The CUDA tier's sampling inside megatron-core's engine: ``SeededSampler`` replaces
megatron-core's sampling (one generator for all requests) with the trainer's. Each request draws
the uniform of its token at position p from ``token_uniform(seed, p)`` and samples with
``sample_with_alternatives``, so tokens do not depend on batch composition, every TP rank draws
the same token without a broadcast, the logprob is the one of the tempered policy, as the trainer
recomputes it, and a request's ``top_logprobs`` alternatives come from the same distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.rl.inference.protocol import Alternatives
from megatron.rl.inference.sampling import (
    alternatives_of,
    sample_with_alternatives,
    token_uniform,
)


@dataclass(frozen=True)
class RowSampling:
    """How one request samples: its seed and sampling parameters."""

    seed: int
    """The request's sampling seed."""
    temperature: float
    """0 means greedy."""
    top_p: float
    """Nucleus mass; 1 disables."""
    top_k: int
    """0 disables."""
    top_logprobs: int = 0
    """Alternatives returned with each token (``RowResult.alternatives``)."""


class SeededSampler:
    """Samples the next token of each active request from the request's own seeded uniforms.

    Shared by the runner (which registers each request's ``RowSampling``) and the controller
    (which calls ``sample`` inside megatron-core's step); ``take`` hands the runner what the last
    step sampled.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.requests: dict[int, RowSampling] = {}
        self.record_routing = False
        """The controller hands over each step's routes (``keep_routes``)."""
        self._last: list[tuple[int, int, float, Alternatives]] = []
        self._routes: dict[int, torch.Tensor] = {}

    def sample(
        self, logits: torch.Tensor, request_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """Tokens (n,) int64 on ``logits``' device for the n active requests.

        ``logits`` (n, V_padded) are full-vocabulary logits at each request's last fed token;
        ``positions[i]`` is the position of the token being sampled for request i.
        """
        logits = logits.float().clone()
        logits[:, self.vocab_size :] = float("-inf")  # padded embedding rows are never sampled
        params = [self.requests[r] for r in request_ids]
        dev = logits.device
        tokens, logprobs, top_ids, top_values = sample_with_alternatives(
            logits,
            temperature=torch.tensor([p.temperature for p in params], device=dev),
            top_p=torch.tensor([p.top_p for p in params], device=dev),
            top_k=torch.tensor([p.top_k for p in params], device=dev),
            uniforms=torch.tensor(
                [token_uniform(p.seed, pos) for p, pos in zip(params, positions)], device=dev
            ),
            top_n=max((p.top_logprobs for p in params), default=0),
        )
        tops = alternatives_of(params, top_ids, top_values)
        self._last = list(zip(request_ids, tokens.tolist(), logprobs.tolist(), tops))
        return tokens

    def take(self) -> list[tuple[int, int, float, Alternatives]]:
        """(request id, token, logprob, alternatives) of every request the last step sampled,
        then forget."""
        last, self._last = self._last, []
        return last

    def keep_routes(self, routes: dict[int, torch.Tensor]) -> None:
        """Request id -> (fed, L, k) routes of the tokens the last step fed (from the
        controller)."""
        self._routes = routes

    def take_routes(self) -> dict[int, torch.Tensor]:
        """The routes ``keep_routes`` got for the last step (empty if none), then forget."""
        routes, self._routes = self._routes, {}
        return routes
