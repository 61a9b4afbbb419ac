"""Weights from the training ranks to the inference ranks of a non-collocated run, full or delta.

``WeightSender`` (every training rank; collective over its TP group) assembles each parameter
whole (``tensor_parallel.whole``) and training rank 0 broadcasts it over the ``Bridge``;
``WeightReceiver`` (every inference rank) keeps the whole tensors and cuts its own shard of the
inference layout (``tensor_parallel.shard``). A delta refit sends, per tensor, only what
changed since the previous refit: the blocks of ``BLOCK`` elements with a changed bit (and a
bitmask), or the changed elements with their int32 indices, whichever is smaller (bfloat16
weights after an optimizer step keep ~97% of their values, but nearly every block has a changed
one); the receiver patches its whole tensors in place, so full and delta give the same bits. With
``verify`` the sender also sends each tensor's ``position_checksum`` and every inference rank
checks its shards against it (summed over the inference TP group): a lost, moved or changed
value names the tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.rl.refit.bridge import Bridge
from megatron.rl.refit.collocated import UNCHANGED_STRIDE
from megatron.rl.refit.tensor_parallel import (
    global_indices,
    position_checksum,
    shard,
    shard_specs,
    whole,
)

BLOCK = 1024
"""Elements per block of a delta refit (4 KiB of float32): a block is sent when any of its
elements changed (frozen or untouched tensors and rows cost a bit per block)."""


@dataclass(frozen=True)
class TransferStats:
    """What one refit sent (training rank 0; zeros elsewhere)."""

    seconds: float
    """Wall time: gathers, comparison and the broadcast to the inference ranks."""
    bytes_sent: int
    """Bytes broadcast to the inference ranks: the changed blocks (all, for a full refit), the
    bitmasks and the header."""
    changed: float
    """The share of elements whose bits changed since the previous refit (1.0 for a full
    refit)."""
    unchanged_bf16: float
    """The share of elements whose bfloat16 value did not change since the previous refit
    (sampled every ``UNCHANGED_STRIDE``-th element; 0.0 at the first refit)."""


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The raw bits of a flat tensor, as integers of its element size (exact comparison)."""
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(kind)


def _padded(flat: torch.Tensor) -> torch.Tensor:
    blocks = -(-flat.numel() // BLOCK)
    out = flat.new_zeros(blocks * BLOCK)
    out[: flat.numel()] = flat
    return out


class WeightSender:
    """The training side of a non-collocated refit (built on every training rank)."""

    def __init__(
        self,
        model: torch.nn.Module,
        gated_linear_unit: bool,
        tp_group: dist.ProcessGroup | None,
        bridge: Bridge | None,
        delta: bool = False,
        verify: bool = False,
    ) -> None:
        self.model, self.bridge, self.delta, self.verify = model, bridge, delta, verify
        self.specs = shard_specs(model, gated_linear_unit)
        self.group = tp_group
        self.size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self._previous: dict[str, torch.Tensor] = {}
        """Training rank 0: each tensor's padded bits as last sent (delta refit)."""
        self._sampled: dict[str, torch.Tensor] = {}
        """Training rank 0: every ``UNCHANGED_STRIDE``-th value as last sent, in bfloat16."""

    def _wholes(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, param in self.model.named_parameters():
            spec, local = self.specs[name], param.detach()
            parts = [local]
            if spec.dim is not None and self.size > 1:
                parts = [torch.empty_like(local) for _ in range(self.size)]
                dist.all_gather(parts, local.contiguous(), group=self.group)
            out[name] = whole(parts, spec)
        return out

    @torch.no_grad()
    def send(self, version: int, announce: Callable[[], None] | None = None) -> TransferStats:
        """Send policy ``version``'s weights (collective: every training rank, and every inference
        rank's ``WeightReceiver.receive``); ``announce()`` runs on training rank 0 after the
        gathers over the TP group, just before the weights go out (a failure there leaves no
        training rank waiting in a gather)."""
        start = time.perf_counter()
        wholes = self._wholes()
        if self.bridge is None:  # training ranks other than 0 only gather
            return TransferStats(time.perf_counter() - start, 0, 0.0, 0.0)
        if announce is not None:
            announce()
        header, payloads, elements, changed, same, sampled = [], [], 0, 0, 0, 0
        for name, tensor in wholes.items():
            flat = _padded(tensor.reshape(-1).to("cpu"))
            encoding, parts, count = self._encode(name, flat)
            payloads += parts
            elements, changed = elements + tensor.numel(), changed + min(count, tensor.numel())
            sample = tensor.reshape(-1)[::UNCHANGED_STRIDE].to("cpu", torch.bfloat16)
            if name in self._sampled:
                same += int((sample == self._sampled[name]).sum())
                sampled += sample.numel()
            self._sampled[name] = sample
            checksum = None
            if self.verify:
                index = torch.arange(tensor.numel(), dtype=torch.int64)
                checksum = int(position_checksum(tensor.to("cpu"), index))
            header.append((name, tuple(tensor.shape), tensor.dtype, encoding, checksum))
        message = {"version": version, "tensors": header}
        self.bridge.broadcast_object(message, "refit header")
        for payload in payloads:
            self.bridge.broadcast(payload.contiguous())
        sent = sum(p.numel() * p.element_size() for p in payloads)
        masks = sum(e[1].numel() for *_, e, _ in header if e is not None and e[0] == "blocks")
        return TransferStats(
            time.perf_counter() - start,
            sent + masks,
            changed / max(1, elements),
            same / sampled if sampled else 0.0,
        )

    def _encode(self, name: str, flat: torch.Tensor) -> tuple[tuple | None, list, int]:
        """How one padded tensor travels: its header entry (None: whole; ``("blocks", mask)``:
        the changed blocks; ``("elements", count)``: the changed elements' int32 indices and
        values, whichever is smaller), its payloads and how many elements changed."""
        if not self.delta:
            return None, [flat], flat.numel()
        bits = _bits(flat)  # flat is a fresh padded copy: kept as is for the next comparison
        old, self._previous[name] = self._previous.get(name), bits
        if old is None:
            return None, [flat], flat.numel()
        diff = bits != old
        count = int(diff.sum())
        mask = diff.view(-1, BLOCK).any(dim=1)
        block_bytes = int(mask.sum()) * BLOCK * flat.element_size() + mask.numel()
        if count * (4 + flat.element_size()) < block_bytes:
            index = diff.nonzero().view(-1).to(torch.int32)
            return ("elements", count), ([index, flat[index.long()]] if count else []), count
        rows = flat.view(-1, BLOCK)[mask]
        return ("blocks", mask), ([rows.reshape(-1)] if rows.numel() else []), count


class WeightReceiver:
    """The inference side of a non-collocated refit (every inference rank): this rank's shards
    of ``model``, laid out over the inference TP group ``tp_group``."""

    def __init__(
        self,
        model: torch.nn.Module,
        gated_linear_unit: bool,
        tp_group: dist.ProcessGroup | None,
        bridge: Bridge,
    ) -> None:
        self.bridge, self.group = bridge, tp_group
        self.specs = shard_specs(model, gated_linear_unit)
        self.params = dict(model.named_parameters())
        self.rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self._wholes: dict[str, torch.Tensor] = {}
        """Each tensor whole and padded, as last received (what a delta patches)."""

    @torch.no_grad()
    def receive(self) -> tuple[int, list[str]]:
        """Receive the next refit into the model (collective); its policy version and the
        tensors whose checksum does not match the sender's (empty without ``verify``)."""
        message = self.bridge.broadcast_object(None, "refit header")
        buffers = []
        for name, shape, dtype, encoding, _ in message["tensors"]:  # every payload first
            numel = torch.Size(shape).numel()
            buffer = self._wholes.get(name)
            if buffer is None:
                buffer = torch.zeros(-(-numel // BLOCK) * BLOCK, dtype=dtype)
                if encoding is None:
                    self._wholes[name] = buffer
            self._patch(buffer, encoding)
            buffers.append(buffer[:numel].view(shape))
        checks = []
        for (name, _, _, encoding, checksum), value in zip(message["tensors"], buffers):
            if encoding is not None and name not in self._wholes:
                raise ValueError(f"refit: a delta for {name} before any full refit")
            if name not in self.params:
                raise ValueError(f"refit: {name} is not a parameter of the inference model")
            spec = self.specs[name]
            self.params[name].copy_(shard(value, spec, self.rank, self.size))
            if checksum is not None:
                checks.append((name, checksum))
        return message["version"], self._mismatches(checks)

    def _patch(self, buffer: torch.Tensor, encoding: tuple | None) -> None:
        """Receive one tensor's payloads into its padded whole ``buffer`` (``_encode``)."""
        broadcast = self.bridge.broadcast
        if encoding is None:
            buffer.copy_(broadcast(torch.empty_like(buffer)))
        elif encoding[0] == "blocks" and encoding[1].any():
            mask = encoding[1]
            rows = broadcast(buffer.new_empty(int(mask.sum()) * BLOCK))
            buffer.view(-1, BLOCK)[mask] = rows.view(-1, BLOCK)
        elif encoding[0] == "elements" and encoding[1]:
            index = broadcast(torch.empty(encoding[1], dtype=torch.int32)).long()
            buffer[index] = broadcast(buffer.new_empty(encoding[1]))

    def _mismatches(self, checks: list[tuple[str, int]]) -> list[str]:
        found = []
        for name, expected in checks:
            dest, spec = self.params[name], self.specs[name]
            index = global_indices(spec, dest.shape, self.rank, self.size, dest.device)
            total = position_checksum(dest, index)  # on the device its group reduces on
            if spec.dim is not None and self.size > 1:
                dist.all_reduce(total, group=self.group)
            if int(total) != expected:
                found.append(name)
        return found
