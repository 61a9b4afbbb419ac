"""The CPU tier's row runner: the trained model with a per-slot KV cache, and seeded sampling.

A ``KVCacheRowRunner`` owns the KV cache of its data-parallel replica. It runs on every rank of the
replica's tensor-parallel group: the forward is collective over that group, the vocab-parallel
logits are gathered, and every TP rank draws the same uniforms, so no broadcast of tokens is
needed inside a replica. The uniform of a request's token at position p is a pure function of
(request seed, p) (``token_uniform``): no RNG state lives in the runner, and a token never
depends on which requests share its batch.

Routing replay (``record_routing``, MoE models): the runner records the experts each router chose
for every token a row feeds and returns them with the row's token (``RowResult.routes``). MoE
models run their own forward (``CachedForward.of`` declines them), one per kind of row.

With expert parallelism the replicas of an expert-parallel group run each engine step's forwards
together (``megatron.rl.models.lockstep``): every step runs a decode forward when any of them has
decode rows and a prefill forward when any has prefill rows, a replica without such rows running a
one-token padding forward in its place (also in a step that gives it no rows at all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron.rl.inference.cpu.cached_forward import CachedForward
from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.protocol import RowResult, RowWork, ScoreOutput, ScoreWork
from megatron.rl.inference.sampling import (
    alternatives_of,
    sample_with_alternatives,
    token_uniform,
)
from megatron.rl.inference.scoring import ScoringForward
from megatron.rl.lora.model import selected_adapters
from megatron.rl.models.lockstep import agreed_counts, expert_lockstep_group, padding_forward
from megatron.rl.models.routing_replay import (
    recorded_routes,
    routing_replays,
    start_recording,
    stop_recording,
)

if TYPE_CHECKING:
    from megatron.rl.inference.backends import RunnerInputs


def shared_prompts(rows: list[RowWork]) -> tuple[list[int], list[int]]:
    """Rows to run, and for each row the position in that list of the row whose forward it
    shares.

    A GRPO group's samples start with the same prompt in the same engine step: rows that feed a
    whole prompt (``start == 0``) of identical tokens are prefilled once, the first of them run
    and the others copy its keys and values (``_copy_prompts``) and its logits, then sample their
    first tokens with their own seeds. Decode rows and distinct prompts run as they are.
    """
    unique: list[int] = []
    source: list[int] = []
    first: dict[tuple[int, ...], int] = {}
    for b, row in enumerate(rows):
        if row.start == 0 and len(row.tokens) > 1 and row.tokens in first:
            source.append(first[row.tokens])
            continue
        if row.start == 0 and len(row.tokens) > 1:
            first[row.tokens] = len(unique)
        source.append(len(unique))
        unique.append(b)
    return unique, source


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
        record_routing: bool = False,
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
        self.record_routing = record_routing and bool(routing_replays(model))
        """Routing replay: each ``RowResult`` carries the routes of the tokens its row fed (a
        model without routers records nothing)."""
        if self.record_routing and self.cached_forward is not None:
            raise ValueError(
                "record_routing: the runner's cached forward does not run the model's routers, "
                "so it cannot record their routes; this model must run its own forward"
            )
        self.lockstep_group = expert_lockstep_group(model)
        """TP x EP group whose ranks run every forward together (None: no expert parallelism)."""
        self.scoring = ScoringForward(model, vocab_size, self.device, tp_group, self._autocast)
        """Plain forwards that score sequences (``score``)."""

    @torch.no_grad()
    def run(self, rows: list[RowWork]) -> list[RowResult]:
        """Feed ``rows`` through the model and sample one token for each, in row order.

        The model runs in whatever mode it is in: the owner of the generation window puts it in
        eval mode for the window (not per step: toggling every module costs ~0.25 ms a step).
        Rows of different named LoRA adapter sets (``RowWork.adapter``, a multi-adapter
        server's) run in one forward per set, each with its set selected.
        """
        sets = sorted({r.adapter for r in rows if r.adapter is not None})
        if not sets:
            return self._run(rows)
        if self.lockstep_group is not None:
            raise ValueError("per-request LoRA adapters are not supported with expert parallelism")
        results: dict[int, RowResult] = {}
        for name in [None, *sets]:
            chosen = [i for i, r in enumerate(rows) if r.adapter == name]
            if chosen:
                with selected_adapters(self.model, name):
                    done = self._run([rows[i] for i in chosen])
                results.update(zip(chosen, done))
        return [results[i] for i in range(len(rows))]

    def _run(self, rows: list[RowWork]) -> list[RowResult]:
        """``run`` of rows that share their adapter set (the one selected)."""
        if not rows and self.lockstep_group is None:
            return []
        if self.cached_forward is not None:  # packed tokens: one pass for every kind of row
            unique, source = shared_prompts(rows)
            logits, _ = self._forward_last_logits([rows[i] for i in unique])  # (U, V)
            if len(unique) < len(rows):  # a group's samples: one prefill, the KV copied
                self._copy_prompts(rows, unique, source)
                logits = logits[torch.tensor(source)]  # (B, V)
            return self._sample(rows, logits)
        # Decode rows (one token) and prefill rows (many) go in separate forwards so that
        # single-token rows are not padded to the longest prompt.
        decode = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        prefill = [i for i, r in enumerate(rows) if len(r.tokens) > 1]
        kinds = (decode, prefill)
        runs = agreed_counts([int(bool(b)) for b in kinds], self.lockstep_group, self.device)
        parts = []
        for batch, run in zip(kinds, runs):
            if batch:
                parts.append(self._forward_last_logits([rows[i] for i in batch]))
            elif run:  # another expert-parallel replica runs this forward
                with self._autocast():
                    padding_forward(self.model, self.device)
        if not parts:
            return []
        routes = None
        if self.record_routing:  # (n_fed, L, k) per row, in row order
            by_row = dict(zip(decode + prefill, [r for _, part in parts for r in part]))
            routes = [by_row[b] for b in range(len(rows))]
        if len(parts) == 1:  # one kind of row: already in row order
            logits = parts[0][0]  # (B, V)
        else:
            order = torch.argsort(torch.tensor(decode + prefill))
            logits = torch.cat([part for part, _ in parts])[order]  # (B, V)
        return self._sample(rows, logits, routes)

    def score(self, jobs: list[ScoreWork]) -> list[ScoreOutput]:
        """A plain forward of each job's tokens (``scoring.py``); the KV cache is untouched."""
        return self.scoring(jobs)

    def _copy_prompts(self, rows: list[RowWork], unique: list[int], source: list[int]) -> None:
        """Give each row whose prompt was prefilled in another row's slot that slot's keys and
        values at the prompt's positions."""
        by_length: dict[int, list[tuple[int, int]]] = {}
        for b, s in enumerate(source):
            if unique[s] != b:  # (destination slot, source slot) by prompt length
                by_length.setdefault(len(rows[b].tokens), []).append(
                    (rows[b].slot, rows[unique[s]].slot)
                )
        cache = self.cache
        cache.zero_slots_below(max(d for pairs in by_length.values() for d, _ in pairs) + 1)
        cache.zero_positions_below(max(by_length))
        for length, pairs in by_length.items():
            dst = torch.tensor([d for d, _ in pairs], device=self.device)
            src = torch.tensor([s for _, s in pairs], device=self.device)
            for tensor in (cache.keys, cache.values):  # (layers, slots, heads, S, D)
                tensor[:, dst, :, :length] = tensor[:, src, :, :length]

    def end_window(self, idle: bool = False) -> None:
        """The weights may change before the next window, so the forward's copies of them are
        dropped. The KV cache stays valid across windows for the requests in flight; when none
        is (``idle``: always at forced lag 0) its memory is released until the next window."""
        if self.cached_forward is not None:
            self.cached_forward.transposed.clear()
        if idle:
            self.cache.release()

    def export_slots(
        self, positions: dict[int, int]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The keys and values of each slot's first ``positions[slot]`` positions, every layer:
        slot -> (keys, values), each (layers, kv_heads, n, head_dim) on the CPU (a checkpoint of
        the requests in flight; ``import_slots`` puts them back)."""
        cache = self.cache
        return {
            slot: (
                cache.keys[:, slot, :, :n].to("cpu", copy=True),
                cache.values[:, slot, :, :n].to("cpu", copy=True),
            )
            for slot, n in positions.items()
        }

    def import_slots(self, saved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``export_slots``'s tensors back; the rest of those slots reads as zeros, as in a
        fresh cache (positions past a request's length are masked: their contents never count)."""
        if not saved:
            return
        cache = self.cache
        expected = (cache.keys.shape[0], cache.keys.shape[2], cache.keys.shape[4])
        cache.zero_slots_below(max(saved) + 1)
        cache.zero_positions_below(max(keys.shape[2] for keys, _ in saved.values()))
        for slot, (keys, values) in saved.items():
            shape = (keys.shape[0], keys.shape[1], keys.shape[3])
            if shape != expected or keys.shape != values.shape or keys.shape[2] > cache.max_seq_len:
                raise ValueError(
                    f"saved KV cache of slot {slot} has shape {tuple(keys.shape)}; this engine's "
                    f"cache holds (layers, kv_heads, head_dim) = {expected} up to "
                    f"{cache.max_seq_len} positions"
                )
            n = keys.shape[2]
            cache.keys[:, slot, :, :n] = keys.to(cache.keys.device, cache.keys.dtype)
            cache.values[:, slot, :, :n] = values.to(cache.values.device, cache.values.dtype)

    def _forward_last_logits(
        self, rows: list[RowWork]
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Full-vocabulary logits at each row's last new token: (B, V_padded) float32; with
        ``record_routing`` the (len(tokens), L, k) routes of each row's tokens (else None)."""
        width = max(len(r.tokens) for r in rows)
        ids = torch.tensor([r.tokens + (0,) * (width - len(r.tokens)) for r in rows])  # (B, T)
        starts = torch.tensor([r.start for r in rows])
        lengths = torch.tensor([len(r.tokens) for r in rows])
        positions = starts[:, None] + torch.arange(width)[None, :]  # (B, T)
        positions = positions.clamp(max=self.cache.max_seq_len - 1)  # padding stays in range
        slots = torch.tensor([r.slot for r in rows])
        dev = self.device
        with (
            self.cache.step(slots.to(dev), starts.to(dev), lengths.to(dev)) as step,
            self._autocast(),
        ):
            if self.cached_forward is not None:
                logits = self.cached_forward(ids.to(dev), positions.to(dev), step)  # (B, V/tp)
            else:
                if self.record_routing:
                    start_recording(self.model)
                out = self.model(ids.to(dev), positions.to(dev), None)  # (B, T, V/tp)
                logits = out[torch.arange(len(rows), device=dev), (lengths - 1).to(dev)]
        routes = self._row_routes(rows, width) if self.record_routing else None
        return self._gather_vocab(logits.float()), routes

    def _row_routes(self, rows: list[RowWork], width: int) -> list[torch.Tensor]:
        """Each row's (len(tokens), L, k) int16 routes from the last forward over the
        right-padded (B, width) rows (router rows are sequence-major: ``s * B + b``); stops the
        recording."""
        recorded = recorded_routes(self.model)  # (width * B, L, k)
        stop_recording(self.model)
        batch = len(rows)
        if recorded is None or recorded.shape[0] != width * batch:
            got = None if recorded is None else tuple(recorded.shape)
            raise RuntimeError(
                f"record_routing: the forward over {batch} rows of {width} tokens recorded "
                f"routes of shape {got}, not ({width * batch}, layers, topk) (sequence "
                "parallelism splits the tokens over ranks: it cannot be recorded here)"
            )
        grid = recorded.cpu().view(width, batch, *recorded.shape[1:])  # (T, B, L, k)
        return [grid[: len(r.tokens), b].clone() for b, r in enumerate(rows)]

    def _autocast(self) -> torch.autocast:
        """The forward's precision: ``compute_dtype`` under ``torch.autocast`` (off without)."""
        dtype = self.compute_dtype or torch.bfloat16
        return torch.autocast(self.device.type, dtype, enabled=self.compute_dtype is not None)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V/tp) vocab-parallel logits -> (B, V_padded), padding ids masked to -inf."""
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        logits[:, self.vocab_size :] = float("-inf")
        return logits.cpu()

    def _sample(
        self,
        rows: list[RowWork],
        logits: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
    ) -> list[RowResult]:
        uniforms = torch.tensor([token_uniform(r.seed, r.start + len(r.tokens)) for r in rows])
        tokens, logprobs, top_ids, top_values = sample_with_alternatives(
            logits,
            temperature=torch.tensor([r.temperature for r in rows]),
            top_p=torch.tensor([r.top_p for r in rows]),
            top_k=torch.tensor([r.top_k for r in rows]),
            uniforms=uniforms,
            top_n=max(r.top_logprobs for r in rows),
        )
        routes = routes or [None] * len(rows)
        tops = alternatives_of(rows, top_ids, top_values)
        return [
            RowResult(slot=r.slot, token=int(t), logprob=float(lp), routes=rt, alternatives=top)
            for r, t, lp, rt, top in zip(rows, tokens.tolist(), logprobs.tolist(), routes, tops)
        ]


def build_kv_cache_runner(inputs: RunnerInputs) -> KVCacheRowRunner:
    """The ``cpu`` backend's provider (``backends.BACKENDS``): a ``KVCacheRowRunner`` over a new
    per-slot KV cache of the scheduler's capacity for this rank's heads, in the compute dtype (the
    model's without one)."""
    mc = inputs.model.config
    cache = KVCache(
        num_layers=mc.num_layers,
        num_slots=inputs.config.num_slots,
        max_seq_len=inputs.config.max_seq_len,
        num_kv_heads=mc.num_query_groups // inputs.tp_size,
        head_dim=mc.kv_channels,
        dtype=inputs.compute_dtype or mc.params_dtype,
        device=inputs.device,
    )
    return KVCacheRowRunner(
        inputs.model,
        cache,
        inputs.vocab_size,
        inputs.tp_group,
        inputs.compute_dtype,
        record_routing=inputs.config.record_routing,
    )
