"""Float64 metric sums by name, reduced over micro-batches and ranks as one vector."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NamedSums:
    """Float64 sums by name, stored as one vector in a fixed key order (for one reduction)."""

    keys: tuple[str, ...]
    values: torch.Tensor
    """(K,) float64 on the CPU."""

    @classmethod
    def zeros(cls, keys: tuple[str, ...]) -> NamedSums:
        """All-zero sums of ``keys``."""
        return cls(keys, torch.zeros(len(keys), dtype=torch.float64))

    @classmethod
    def of(cls, sums: dict[str, torch.Tensor], keys: tuple[str, ...]) -> NamedSums:
        """The scalar tensors of ``sums`` in the order of ``keys`` (which must match exactly)."""
        if set(sums) != set(keys):
            raise ValueError(f"metric sums {sorted(sums)} do not match the expected {list(keys)}")
        return cls(keys, torch.stack([sums[k].detach().double().cpu() for k in keys]))

    def __add__(self, other: NamedSums) -> NamedSums:
        if other.keys != self.keys:
            raise ValueError(f"cannot add sums of {other.keys} to sums of {self.keys}")
        return NamedSums(self.keys, self.values + other.values)

    def as_dict(self) -> dict[str, float]:
        """Name -> value."""
        return dict(zip(self.keys, self.values.tolist()))
