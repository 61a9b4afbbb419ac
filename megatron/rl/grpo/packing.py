"""Sequence packing: several rollouts share one row, each attending only to itself.

Right-padded rows waste compute on padding when lengths vary. Packing places the real tokens of
the rows of a micro-batch into fewer rows of at most ``capacity`` tokens (first-fit decreasing,
deterministic). Isolation per sequence:

* positions restart at 0 for every sequence (the learned position table sees what it sees
  unpacked);
* the attention mask is block-diagonal and causal inside each block (megatron-core convention:
  ``True`` = masked), so no token attends across sequences; a row's trailing padding is a block of
  its own, so every query attends to at least itself.

The model's per-token outputs are mapped back to the unpacked (B, T) layout with ``unpack``; the
loss is then computed on exactly the tensors of the unpacked path, so packed and unpacked losses
agree up to floating-point rounding of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Where every real token of a (B, T) right-padded batch goes in the packed (R, S) batch."""

    row: torch.Tensor
    """(B,) int64 packed row of each sequence (-1: empty sequence, not packed)."""
    offset: torch.Tensor
    """(B,) int64 first column of each sequence in its packed row."""
    lengths: torch.Tensor
    """(B,) int64 real tokens per sequence."""
    num_rows: int
    """R: packed rows (at least 1)."""
    width: int
    """S: packed row length (the longest packed row)."""

    @property
    def segment_ids(self) -> torch.Tensor:
        """(R, S) int64: index of the sequence at each packed position; padding gets -1 - row."""
        seg = -1 - torch.arange(self.num_rows)[:, None].expand(self.num_rows, self.width).clone()
        for b in range(self.row.shape[0]):
            r, o, n = int(self.row[b]), int(self.offset[b]), int(self.lengths[b])
            if r >= 0:
                seg[r, o : o + n] = b
        return seg

    @property
    def position_ids(self) -> torch.Tensor:
        """(R, S) int64 positions restarting at 0 for every sequence (padding: 0)."""
        pos = torch.zeros(self.num_rows, self.width, dtype=torch.long)
        for b in range(self.row.shape[0]):
            r, o, n = int(self.row[b]), int(self.offset[b]), int(self.lengths[b])
            if r >= 0:
                pos[r, o : o + n] = torch.arange(n)
        return pos

    def attention_mask(self) -> torch.Tensor:
        """(R, 1, S, S) bool, True where query i must NOT attend key j (other block or j > i)."""
        seg = self.segment_ids  # (R, S)
        same = seg[:, :, None] == seg[:, None, :]  # (R, S, S)
        causal = torch.ones(self.width, self.width, dtype=torch.bool).tril()  # (S, S)
        return ~(same & causal)[:, None]

    def _index(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat indices: (B, T) positions with a real token, and their packed (row, column)."""
        cols = torch.arange(t)[None, :]  # (1, T)
        real = (cols < self.lengths[:, None]) & (self.row[:, None] >= 0)  # (B, T)
        b_idx, t_idx = real.nonzero(as_tuple=True)
        return real, self.row[b_idx], self.offset[b_idx] + t_idx

    def pack(self, x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """(B, T, ...) -> (R, S, ...): real tokens moved to their packed place; rest ``fill``."""
        real, rows, cols = self._index(x.shape[1])
        out = torch.full(
            (self.num_rows, self.width, *x.shape[2:]), fill, dtype=x.dtype, device=x.device
        )
        out[rows.to(x.device), cols.to(x.device)] = x[real.to(x.device)]
        return out

    def unpack(self, y: torch.Tensor, t: int) -> torch.Tensor:
        """(R, S, ...) -> (B, T, ...), differentiable; positions without a token get 0."""
        real, rows, cols = self._index(t)
        dev = y.device
        out = y.new_zeros((self.row.shape[0], t, *y.shape[2:]))
        out = out.index_put((*real.to(dev).nonzero(as_tuple=True),), y[rows.to(dev), cols.to(dev)])
        return out


def pack_sequences(lengths: torch.Tensor, capacity: int) -> PackedLayout:
    """First-fit-decreasing packing of sequences of ``lengths`` into rows of ``capacity`` tokens.

    Longer sequences are placed first (ties by index), each into the first row it fits; a sequence
    longer than ``capacity`` gets a row of its own. Empty sequences are not packed.
    """
    lengths = lengths.to(torch.long).cpu()
    order = sorted(range(lengths.shape[0]), key=lambda b: (-int(lengths[b]), b))
    used: list[int] = []  # tokens per packed row
    row = torch.full_like(lengths, -1)
    offset = torch.zeros_like(lengths)
    for b in order:
        n = int(lengths[b])
        if n == 0:
            continue
        r = next((i for i, u in enumerate(used) if u + n <= capacity), len(used))
        if r == len(used):
            used.append(0)
        row[b], offset[b] = r, used[r]
        used[r] += n
    return PackedLayout(
        row=row,
        offset=offset,
        lengths=lengths,
        num_rows=max(1, len(used)),
        width=max([1, *used]),
    )
