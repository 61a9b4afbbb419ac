"""Messages of the keyed data plane: a JSON header and the fields' bytes, over point-to-point.

A frame is two messages: an int64 pair (header length, payload length), then one uint8 tensor
holding the UTF-8 JSON header followed by the payload (skipped when both are empty). Field
values travel field by field, each key's tensor flattened in key order; the header carries each
value's element count and each field's dtype and rank, so the receiver rebuilds the tensors
exactly (bitwise).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron.rl.dataplane.store import Fields, FieldSpec

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}
"""The dtypes a field may have, by name."""


def spec_to_json(spec: FieldSpec) -> list:
    """``[dtype name, ndim]``."""
    name = str(spec.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"a data-plane field cannot hold {spec.dtype} (supported: {list(DTYPES)})")
    return [name, spec.ndim]


def spec_from_json(value: Sequence) -> FieldSpec:
    """The inverse of ``spec_to_json``."""
    return FieldSpec(DTYPES[value[0]], int(value[1]))


def pack(fields: Fields) -> tuple[dict[str, Any], torch.Tensor]:
    """(header entries ``specs`` and ``sizes``, uint8 payload) of ``fields``."""
    specs, sizes, chunks = {}, [], []
    for name, values in fields.items():
        specs[name] = spec_to_json(FieldSpec.of(name, values)) if values else None
        sizes.append([v.numel() for v in values])
        chunks += [v.detach().reshape(-1).cpu().contiguous().view(torch.uint8) for v in values]
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return {"specs": specs, "sizes": sizes}, payload


def unpack(header: dict[str, Any], payload: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """The fields ``pack`` packed (tensors own their memory)."""
    out: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for (name, spec_json), sizes in zip(header["specs"].items(), header["sizes"]):
        if spec_json is None:
            out[name] = []
            continue
        spec = spec_from_json(spec_json)
        itemsize = torch.empty(0, dtype=spec.dtype).element_size()
        nbytes = sum(sizes) * itemsize
        flat = payload[offset : offset + nbytes].clone().view(spec.dtype)  # aligned copy
        offset += nbytes
        values = list(torch.split(flat, sizes))
        out[name] = [v.reshape(()) if spec.ndim == 0 else v for v in values]
    if offset != payload.numel():
        raise ValueError(f"frame payload has {payload.numel()} bytes, the header names {offset}")
    return out


def send_frame(
    header: dict[str, Any],
    payload: torch.Tensor,
    dst: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Send ``header`` and ``payload`` to global rank ``dst``; the bytes sent."""
    text = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    sizes = torch.tensor([text.numel(), payload.numel()], dtype=torch.long)
    dist.send(sizes.to(device), dst, group=group)
    body = torch.cat([text, payload.cpu()])
    if body.numel():
        dist.send(body.to(device), dst, group=group)
    return sizes.numel() * 8 + body.numel()


def recv_frame(
    src: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[dict[str, Any], torch.Tensor, int]:
    """(header, payload, bytes received) of the next frame from global rank ``src``."""
    sizes = torch.zeros(2, dtype=torch.long, device=device)
    dist.recv(sizes, src, group=group)
    text_len, payload_len = (int(v) for v in sizes.cpu())
    body = torch.zeros(text_len + payload_len, dtype=torch.uint8, device=device)
    if body.numel():
        dist.recv(body, src, group=group)
    body = body.cpu()
    header = json.loads(bytes(body[:text_len].numpy()).decode())
    return header, body[text_len:], sizes.numel() * 8 + body.numel()
