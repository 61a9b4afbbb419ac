"""A CPU stand-in for megatron-core's ``DynamicInferenceEngine`` as ``DynamicEngineRowRunner`` uses it.

It keeps megatron-core's request semantics that the runner relies on: a FIFO waiting queue, at
most ``max_requests`` active requests, every active request advanced by every step, a request
finishes when it samples its termination id or reaches its token budget, ``suspend`` turns active
requests into waiting ones whose prompt is prompt + generated tokens (re-prefilled at
``resume``), ids in ``stop_word_finished_request_ids`` finish at their next step without a token,
and requests that do not fit the sequence length fail. Forwards are full recomputations of a real
model (or any ``logits_fn``), sampled by the runner's ``SeededSampler``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from megatron.core.inference.inference_request import Status


@dataclass
class FakeRequest:
    request_id: int
    prompt: list[int]
    budget: int
    termination_id: int
    generated: list[int] = field(default_factory=list)
    status: Status = Status.WAITING_IN_QUEUE


class FakeRecord:
    """What ``async_bookkeep`` reports per finished request (a one-request record)."""

    def __init__(self, request: FakeRequest) -> None:
        self.request_id = request.request_id
        self.requests = [request]

    def __getitem__(self, index: int) -> FakeRequest:
        return self.requests[index]


class FakeDynamicEngine:
    def __init__(
        self,
        sampler,
        logits_fn: Callable[[list[int]], torch.Tensor],
        max_requests: int = 8,
        max_sequence_length: int = 32,
    ) -> None:
        self.sampler = sampler
        self.logits_fn = logits_fn
        self.max_requests = max_requests
        self.max_sequence_length = max_sequence_length
        self.requests: dict[int, FakeRequest] = {}
        self.waiting_request_ids: deque[int] = deque()
        self.stop_word_finished_request_ids: set[int] = set()
        self.active: list[int] = []
        self.failed: list[int] = []
        self.suspended = False
        self.log: list[tuple] = []
        self._finished: list[int] = []

    def add_request(self, request_id, prompt, sampling_params):
        request = FakeRequest(
            request_id,
            list(prompt),
            sampling_params.num_tokens_to_generate,
            sampling_params.termination_id,
        )
        self.requests[request_id] = request
        self.log.append(("add", request_id, tuple(prompt), request.budget, request.termination_id))
        if len(prompt) + request.budget > self.max_sequence_length:
            request.status = Status.FAILED
            self.failed.append(request_id)
        else:
            self.waiting_request_ids.append(request_id)

    async def async_forward(self):
        if self.suspended:
            raise RuntimeError("stepped while suspended")
        while self.waiting_request_ids and len(self.active) < self.max_requests:
            self.active.append(self.waiting_request_ids.popleft())
        self._finished = []
        if not self.active:
            return None, {}, 0.0, 0
        stopped = [r for r in self.active if r in self.stop_word_finished_request_ids]
        seqs = [self.requests[r].prompt + self.requests[r].generated for r in self.active]
        logits = torch.stack([self.logits_fn(s) for s in seqs])
        await asyncio.sleep(0)
        tokens = self.sampler.sample(logits, list(self.active), [len(s) for s in seqs]).tolist()
        self.log.append(("step", tuple(self.active)))
        for rid, token in zip(list(self.active), tokens):
            request = self.requests[rid]
            if rid in stopped:
                self.stop_word_finished_request_ids.discard(rid)
                self._finished.append(rid)
                continue
            request.generated.append(token)
            if token == request.termination_id or len(request.generated) >= request.budget:
                self._finished.append(rid)
        self.active = [r for r in self.active if r not in self._finished]
        return {"sample": torch.tensor(tokens)}, {}, 0.0, 0

    async def async_bookkeep(self, result, context_state, step_time, step_count):
        records = []
        for rid in self._finished + self.failed:
            request = self.requests.pop(rid)
            if request.status != Status.FAILED:
                request.status = Status.COMPLETED
            records.append(FakeRecord(request))
        self._finished, self.failed = [], []
        return {"finished_request_records": records}

    def suspend(self):
        self.suspended = True
        self.log.append(("suspend",))
        for rid in self.active:  # checkpoint: prompt += generated, budget -= generated
            request = self.requests[rid]
            request.prompt = request.prompt + request.generated
            request.budget -= len(request.generated)
            request.generated = []
        self.waiting_request_ids = deque(self.active + list(self.waiting_request_ids))
        self.active = []

    def resume(self):
        self.suspended = False
        self.log.append(("resume",))
