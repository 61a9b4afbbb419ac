"""The data plane on the TransferQueue package (``pip install '.[transferqueue]'``, on Ray).

Samples live in TransferQueue's in-memory storage units (Ray actors), under their keys, one
TransferQueue partition per data-plane partition, with the per-key tags stored alongside
(``kv_batch_put(..., tags=)``). Rank 0 (the owner) starts a local Ray and TransferQueue's
controller and one storage unit, then hands the Ray address to the other ranks, which attach. Every
rank reads and writes its own keys directly to the storage units; nothing of the payload passes
through rank 0.

TransferQueue (0.1.11) overwrites a field written twice and answers a read of a missing field with
an empty result, so the owner keeps a ledger of the partition (keys, fields per key, types, tags)
and checks every request against it first (a small object gather and broadcast over the world
group), with the same errors as the in-process store. A 1-d field travels as a jagged nested
tensor and a 0-d one as a dense column; the ledger's types rebuild each value exactly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

import torch
import torch.distributed as dist

from megatron.rl.dataplane.base import DataPlane
from megatron.rl.dataplane.keyed import DataPlaneError
from megatron.rl.dataplane.store import (
    BatchMeta,
    Fields,
    FieldSpec,
    check_keys,
    check_new_samples,
)

TQ_CONFIG: dict[str, Any] = {
    "controller": {"polling_mode": True},
    "backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 1}},
}
"""TransferQueue's settings: one storage unit (with the controller, 2 of Ray's logical CPUs: the
default 2 units would wait forever for a third on a 2-CPU Ray) and no blocking reads."""
RAY_CPUS = 2
AUTH_MODE = "RAY_AUTH_MODE"
"""Logical CPUs of the owner's local Ray: the controller's and the storage unit's."""


def _require_installed() -> None:
    """Raise (on every rank alike, before any communication) without the extra's modules."""
    missing = [m for m in ("ray", "transfer_queue", "tensordict") if find_spec(m) is None]
    if missing:
        raise ImportError(
            f"--rl-data-plane transferqueue needs the transferqueue extra "
            f"(pip install '.[transferqueue]'): no module {missing[0]!r}"
        )


def _import_backend():
    try:
        import ray
        import transfer_queue
        from tensordict import TensorDict
    except ImportError as exc:
        raise ImportError(
            f"--rl-data-plane transferqueue needs the transferqueue extra "
            f"(pip install '.[transferqueue]'): {exc}"
        ) from exc
    return ray, transfer_queue, TensorDict


@dataclass
class _Ledger:
    """What the owner knows of one partition (the values live in TransferQueue)."""

    step: int
    keys: dict[str, set[str]] = field(default_factory=dict)
    """Key -> the fields written to it, keys in the order written."""
    specs: dict[str, FieldSpec] = field(default_factory=dict)
    tags: dict[str, list[int]] = field(default_factory=dict)
    attrs: dict[str, int] = field(default_factory=dict)


class TransferQueueDataPlane(DataPlane):
    """Samples in TransferQueue's storage units, fetched and written by key from every rank."""

    def __init__(self, rank: int, world_size: int, device: torch.device, owner: int = 0) -> None:
        super().__init__(rank, world_size, device, owner)
        _require_installed()
        os.environ.setdefault("TQ_NUM_THREADS", "2")  # its threads per call; the data is small
        self._ledgers: dict[str, _Ledger] = {}
        self._started_ray = False
        self._closed = False
        with self.stats.timed():
            address = None
            if self.is_owner:
                self._ray, self._tq, self._TensorDict = _import_backend()
                if not self._ray.is_initialized():
                    self._ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
                    self._started_ray = True
                self._tq.init(TQ_CONFIG)
                # Ray 2.60 gives a cluster it starts a token (~/.ray/auth_token) by default, but a
                # process joining one expects none unless told: pass the owner's mode along
                address = (self._ray.get_runtime_context().gcs_address, os.environ.get(AUTH_MODE))
            address, auth_mode = self._broadcast(address)
            if not self.is_owner:  # Ray reads the mode when imported
                os.environ[AUTH_MODE] = auth_mode or "token"
                self._ray, self._tq, self._TensorDict = _import_backend()
                if not self._ray.is_initialized():
                    self._ray.init(address=address, log_to_driver=False)
                    self._started_ray = True
                self._tq.init()  # attaches to the owner's controller

    # ------------------------------------------------------------------ owner's writes

    def put(
        self,
        partition: str,
        step: int,
        keys: Sequence[str],
        fields: Fields,
        tags: Mapping[str, Sequence[int]] | None = None,
        attrs: Mapping[str, int] | None = None,
    ) -> None:
        """Write new samples ``keys`` of ``step`` (owner only), each key with its tags."""
        self._require_owner()
        with self.stats.timed():
            ledger = self._ledgers.get(partition) or _Ledger(step)
            specs, tags = check_new_samples(
                partition,
                step,
                ledger.step,
                ledger.keys,
                ledger.specs,
                ledger.tags,
                keys,
                fields,
                tags,
            )
            per_key = [
                {"step": step, **{name: values[i] for name, values in tags.items()}}
                for i in range(len(keys))
            ]
            self._tq.kv_batch_put(
                keys=list(keys),
                partition_id=partition,
                fields=self._to_tensordict(fields, len(keys)),
                tags=per_key,
            )
            self.stats.bytes_moved += _payload_bytes(fields)
            self.stats.messages += 1
            self._ledgers[partition] = ledger
            ledger.specs.update(specs)
            ledger.attrs.update(attrs or {})
            for key in keys:
                ledger.keys[key] = set(fields)
            for name, values in tags.items():
                ledger.tags.setdefault(name, []).extend(values)

    def update(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add ``fields`` to existing samples (owner only)."""
        self._require_owner()
        with self.stats.timed():
            summary = _summary(fields)
            error = self._check_write(partition, list(keys), summary)
            if error:
                raise KeyError(error)
            self._write_fields(partition, keys, fields)
            self._record_write(partition, list(keys), summary)

    def meta(self, partition: str) -> BatchMeta:
        """Keys, complete fields, tags and attributes of ``partition`` (owner only)."""
        self._require_owner()
        ledger = self._ledger(partition)
        return BatchMeta(
            partition=partition,
            step=ledger.step,
            keys=tuple(ledger.keys),
            fields={
                n: s for n, s in ledger.specs.items() if all(n in f for f in ledger.keys.values())
            },
            tags={name: tuple(values) for name, values in ledger.tags.items()},
            attrs=dict(ledger.attrs),
        )

    # ------------------------------------------------------------------ collective calls

    def fetch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[torch.Tensor]]:
        """``fields`` of ``keys``, read by this rank from the storage units (collective: the
        owner checks every rank's request first)."""
        with self.stats.timed():
            request = (partition, list(keys), list(fields))
            answers = self._ask_owner(request, self._check_fetch)
            _, specs = answers[self.rank]
            self._raise_all(answers)
            out: dict[str, list[torch.Tensor]] = {name: [] for name in fields}
            if not keys:
                return out
            td = self._tq.kv_batch_get(
                keys=list(keys), partition_id=partition, select_fields=list(fields)
            )
            self.stats.messages += 1
            for name in fields:
                out[name] = _values(td[name], FieldSpec(*specs[name]), len(keys), name)
            self.stats.bytes_moved += _payload_bytes(out)
            return out

    def write(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add each rank's ``fields`` to its ``keys`` (collective; checked by the owner first)."""
        with self.stats.timed():
            request = (partition, list(keys), _summary(fields))  # types only, not the values
            answers = self._ask_owner(request, self._check_rank_write)
            self._raise_all(answers)
            if keys:
                self._write_fields(partition, keys, fields)
            self._barrier()  # every rank's write is stored before anyone reads or clears

    def clear(self, partition: str) -> None:
        """Drop ``partition`` from TransferQueue and the ledger (collective)."""
        with self.stats.timed():
            self._barrier()
            if self.is_owner and self._ledgers.pop(partition, None) is not None:
                self._tq.get_client().clear_partition(partition)
                self.stats.messages += 1

    def close(self) -> None:
        """The owner stops TransferQueue's actors; every rank leaves the Ray it started or
        joined (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.is_owner:
            self._tq.close()
        if self._started_ray:
            self._ray.shutdown()

    # ------------------------------------------------------------------ the owner's checks

    def _check_fetch(self, rank: int, request: tuple) -> tuple[str | None, dict]:
        partition, keys, fields = request
        ledger = self._ledgers.get(partition)
        if ledger is None:
            return f"rank {rank}: no partition {partition!r}", {}
        for key in keys:
            if key not in ledger.keys:
                return f"rank {rank}: partition {partition!r} has no key {key!r}", {}
            missing = [name for name in fields if name not in ledger.keys[key]]
            if missing:
                return (
                    f"rank {rank}: partition {partition!r}: key {key!r} has no field "
                    f"{missing[0]!r}",
                    {},
                )
        specs = {n: (ledger.specs[n].dtype, ledger.specs[n].ndim) for n in fields}
        return None, specs

    def _check_rank_write(self, rank: int, request: tuple) -> tuple[str | None, dict]:
        partition, keys, summary = request
        error = self._check_write(partition, keys, summary)
        if error is None and keys:
            self._record_write(partition, keys, summary)
        return (None if error is None else f"rank {rank}: {error}"), {}

    def _check_write(self, partition: str, keys: list[str], summary: dict) -> str | None:
        """Why ``keys`` cannot take the fields of ``summary`` (``_summary``), or None."""
        if not keys:
            return None
        ledger = self._ledgers.get(partition)
        if ledger is None:
            return f"no partition {partition!r} (partitions: {list(self._ledgers)})"
        try:
            check_keys(keys)
        except ValueError as exc:
            return str(exc)
        for name, (count, spec) in summary.items():
            if isinstance(spec, str):
                return spec
            if count != len(keys):
                return f"field {name!r} has {count} values for {len(keys)} keys"
            if name in ledger.specs and ledger.specs[name] != spec:
                return f"field {name!r} is {ledger.specs[name]}, got {spec}"
        missing = [k for k in keys if k not in ledger.keys]
        if missing:
            return f"partition {partition!r} has no keys {missing[:4]}"
        for name in summary:
            rewritten = [k for k in keys if name in ledger.keys[k]]
            if rewritten:
                return f"field {name!r} of keys {rewritten[:4]} is already written"
        return None

    def _record_write(self, partition: str, keys: list[str], summary: dict) -> None:
        ledger = self._ledgers[partition]
        for name, (_, spec) in summary.items():
            ledger.specs[name] = spec
            for key in keys:
                ledger.keys[key].add(name)

    # ------------------------------------------------------------------ plumbing

    def _write_fields(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        self._tq.kv_batch_put(
            keys=list(keys),
            partition_id=partition,
            fields=self._to_tensordict(fields, len(keys)),
        )
        self.stats.bytes_moved += _payload_bytes(fields)
        self.stats.messages += 1

    def _to_tensordict(self, fields: Fields, num_keys: int):
        columns = {}
        for name, values in fields.items():
            values = [v.detach().cpu() for v in values]
            if values[0].dim() == 0:
                columns[name] = torch.stack(values)  # (N,)
            else:  # (N, j1) jagged: one row per key, each its own length
                columns[name] = torch.nested.nested_tensor(values, layout=torch.jagged)
        return self._TensorDict(columns, batch_size=num_keys)

    def _ask_owner(self, request: Any, check) -> list[tuple[str | None, dict]]:
        """Every rank's request checked by the owner (``check(rank, request)``), on every
        rank."""
        if self.world_size == 1:
            return [check(self.rank, request)]
        gathered = [None] * self.world_size if self.is_owner else None
        dist.gather_object(request, gathered, dst=self.owner)
        answers = [check(r, gathered[r]) for r in range(self.world_size)] if self.is_owner else None
        self.stats.messages += 2
        return self._broadcast(answers)

    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        message = [value]
        dist.broadcast_object_list(message, src=self.owner, device=self._object_device())
        return message[0]

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @staticmethod
    def _raise_all(answers: list[tuple[str | None, dict]]) -> None:
        errors = [error for error, _ in answers if error]
        if errors:
            raise DataPlaneError("; ".join(errors))

    def _require_owner(self) -> None:
        if not self.is_owner:
            raise RuntimeError(f"rank {self.rank} does not write samples (rank {self.owner} does)")

    def _ledger(self, partition: str) -> _Ledger:
        ledger = self._ledgers.get(partition)
        if ledger is None:
            raise KeyError(f"no partition {partition!r} (partitions: {list(self._ledgers)})")
        return ledger


def _values(column: torch.Tensor, spec: FieldSpec, num_keys: int, name: str) -> list[torch.Tensor]:
    """The per-key tensors of a column TransferQueue returned, with the ledger's type."""
    if column.is_nested:
        values = list(column.unbind())
    elif spec.ndim == 0:
        values = list(column.reshape(num_keys).unbind())
    else:  # every row had the same length
        values = list(column.unbind())
    if len(values) != num_keys:
        raise DataPlaneError(f"field {name!r}: TransferQueue returned {len(values)} of {num_keys}")
    return [v.to(spec.dtype) for v in values]


def _summary(fields: Fields) -> dict[str, tuple[int, FieldSpec | str]]:
    """Each field's value count and type (or why its values have none), for the owner's check."""
    out: dict[str, tuple[int, FieldSpec | str]] = {}
    for name, values in fields.items():
        try:
            out[name] = (len(values), FieldSpec.of(name, values))
        except ValueError as exc:
            out[name] = (len(values), str(exc))
    return out


def _payload_bytes(fields: Mapping[str, Sequence[torch.Tensor]]) -> int:
    return sum(v.numel() * v.element_size() for values in fields.values() for v in values)
