"""The in-process sample store: each sample once under its own key, fields added by name.

A *partition* (``train``, ``val``, ...) holds the samples of one step: keys in the order they were
written, the fields present with their types (``FieldSpec``), per-key integer tags and batch-level
attributes. A sample is written once (``put``); fields are added to existing samples later
(``update``: advantages, logprobs, reference logprobs) and each field of a sample is written once.
``clear`` drops a partition when its step is finished; a partition takes the samples of one step
at a time. Reads name their keys and fields and fail on any that is missing (no silent empties).

No communication here: ``keyed.KeyedDataPlane`` serves this store to the other ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

Fields = Mapping[str, Sequence[torch.Tensor]]
"""Field name -> one tensor per key (0-d for a scalar field, 1-d for a sequence field)."""


@dataclass(frozen=True)
class FieldSpec:
    """The type of a field: the dtype and the rank of each key's tensor (0 or 1)."""

    dtype: torch.dtype
    ndim: int

    def __post_init__(self) -> None:
        if self.ndim not in (0, 1):
            raise ValueError(f"a field holds 0-d or 1-d tensors per key, not {self.ndim}-d")

    @classmethod
    def of(cls, name: str, values: Sequence[torch.Tensor]) -> FieldSpec:
        """The spec shared by ``values`` (raises if they differ in dtype or rank)."""
        if not values:
            raise ValueError(f"field {name!r} has no values")
        specs = {cls(v.dtype, v.dim()) for v in values}
        if len(specs) != 1:
            raise ValueError(f"field {name!r} mixes dtypes or ranks: {sorted(map(str, specs))}")
        return specs.pop()


@dataclass(frozen=True)
class BatchMeta:
    """What a partition holds: enough for a rank to choose and fetch its samples by key."""

    partition: str
    step: int
    keys: tuple[str, ...]
    """Every key, in the order written."""
    fields: dict[str, FieldSpec]
    """The fields present on every key."""
    tags: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per-key integers by name, aligned with ``keys`` (e.g. a sample's length)."""
    attrs: dict[str, int] = field(default_factory=dict)
    """Batch-level integers by name (e.g. the padded width)."""

    def tag(self, name: str) -> torch.Tensor:
        """(len(keys),) int64 of tag ``name``."""
        if name not in self.tags:
            raise KeyError(f"partition {self.partition!r} has no tag {name!r}")
        return torch.tensor(self.tags[name], dtype=torch.long)


@dataclass
class _Partition:
    step: int
    samples: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    specs: dict[str, FieldSpec] = field(default_factory=dict)
    tags: dict[str, list[int]] = field(default_factory=dict)
    attrs: dict[str, int] = field(default_factory=dict)


class SampleStore:
    """Samples by partition and key, in this process (rank 0 in a job)."""

    def __init__(self) -> None:
        self._partitions: dict[str, _Partition] = {}

    def partitions(self) -> list[str]:
        """The partitions holding samples, in creation order."""
        return list(self._partitions)

    def put(
        self,
        partition: str,
        step: int,
        keys: Sequence[str],
        fields: Fields,
        tags: Mapping[str, Sequence[int]] | None = None,
        attrs: Mapping[str, int] | None = None,
    ) -> BatchMeta:
        """Write new samples ``keys`` of ``step`` with their ``fields`` (each key once)."""
        part = self._partitions.get(partition) or _Partition(step)
        specs, tags = check_new_samples(
            partition, step, part.step, part.samples, part.specs, part.tags, keys, fields, tags
        )
        self._partitions[partition] = part
        part.specs.update(specs)
        part.attrs.update(attrs or {})
        for i, key in enumerate(keys):
            part.samples[key] = {name: values[i] for name, values in fields.items()}
        for name, values in tags.items():
            part.tags.setdefault(name, []).extend(values)
        return self.meta(partition)

    def update(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add ``fields`` to the existing samples ``keys`` (each field of a sample once).

        A field becomes part of the partition's metadata once every sample has it.
        """
        part = self._partition(partition)
        check_keys(keys)
        missing = [k for k in keys if k not in part.samples]
        if missing:
            raise KeyError(f"partition {partition!r} has no keys {missing[:4]}")
        specs = field_specs(fields, len(keys), part.specs)
        for name in specs:
            rewritten = [k for k in keys if name in part.samples[k]]
            if rewritten:
                raise KeyError(f"field {name!r} of keys {rewritten[:4]} is already written")
        for name, values in fields.items():
            part.specs[name] = specs[name]
            for key, value in zip(keys, values):
                part.samples[key][name] = value

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[torch.Tensor]]:
        """``fields`` of ``keys``, in that order; any missing key or field raises ``KeyError``."""
        part = self._partition(partition)
        out: dict[str, list[torch.Tensor]] = {name: [] for name in fields}
        for key in keys:
            sample = part.samples.get(key)
            if sample is None:
                raise KeyError(f"partition {partition!r} has no key {key!r}")
            for name in fields:
                if name not in sample:
                    raise KeyError(f"partition {partition!r}: key {key!r} has no field {name!r}")
                out[name].append(sample[name])
        return out

    def meta(self, partition: str) -> BatchMeta:
        """Keys, complete fields, tags and attributes of ``partition``."""
        part = self._partition(partition)
        return BatchMeta(
            partition=partition,
            step=part.step,
            keys=tuple(part.samples),
            fields={n: s for n, s in part.specs.items() if _everywhere(part, n)},
            tags={name: tuple(values) for name, values in part.tags.items()},
            attrs=dict(part.attrs),
        )

    def clear(self, partition: str) -> None:
        """Drop ``partition`` and its samples (nothing to do if it holds none)."""
        self._partitions.pop(partition, None)

    def _partition(self, partition: str) -> _Partition:
        part = self._partitions.get(partition)
        if part is None:
            raise KeyError(f"no partition {partition!r} (partitions: {self.partitions()})")
        return part


def check_keys(keys: Sequence[str]) -> None:
    """Raise unless ``keys`` are distinct non-empty strings."""
    if len(set(keys)) != len(keys):
        raise ValueError("keys must be distinct")
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"keys must be non-empty strings, got {bad[:4]}")


def check_new_samples(
    partition: str,
    step: int,
    held_step: int,
    held_keys: Collection[str],
    held_specs: Mapping[str, FieldSpec],
    held_tags: Mapping[str, Sequence[int]],
    keys: Sequence[str],
    fields: Fields,
    tags: Mapping[str, Sequence[int]] | None,
) -> tuple[dict[str, FieldSpec], dict[str, list[int]]]:
    """The checks of a ``put`` into a partition that holds ``held_keys`` of ``held_step`` (new
    partitions hold none, of ``step``): one step per partition, distinct new keys, fields
    consistent with ``held_specs``, the same tag names as before with one value per key. Returns
    the fields' specs and the tags as integer lists."""
    if held_step != step:
        raise ValueError(
            f"partition {partition!r} holds step {held_step}; clear it before writing step {step}"
        )
    check_keys(keys)
    taken = [k for k in keys if k in held_keys]
    if taken:
        raise KeyError(f"partition {partition!r}: keys already written: {taken[:4]}")
    specs = field_specs(fields, len(keys), held_specs)
    int_tags = {name: [int(v) for v in values] for name, values in (tags or {}).items()}
    if held_keys and set(int_tags) != set(held_tags):
        raise ValueError(f"partition {partition!r}: new samples need the tags {list(held_tags)}")
    for name, values in int_tags.items():
        if len(values) != len(keys):
            raise ValueError(f"tag {name!r} has {len(values)} values for {len(keys)} keys")
    return specs, int_tags


def field_specs(
    fields: Fields, num_keys: int, known: Mapping[str, FieldSpec]
) -> dict[str, FieldSpec]:
    """The spec of each field, checked against its key count and any spec already ``known``."""
    specs = {}
    for name, values in fields.items():
        if len(values) != num_keys:
            raise ValueError(f"field {name!r} has {len(values)} values for {num_keys} keys")
        spec = FieldSpec.of(name, values)
        if name in known and known[name] != spec:
            raise ValueError(f"field {name!r} is {known[name]}, got {spec}")
        specs[name] = spec
    return specs


def _everywhere(part: _Partition, name: str) -> bool:
    return all(name in sample for sample in part.samples.values())
