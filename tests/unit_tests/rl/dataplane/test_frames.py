"""``frames.pack``/``unpack``: fields travel bitwise, whatever their dtype and rank."""

from __future__ import annotations

import pytest
import torch

from megatron.rl.dataplane.frames import pack, spec_to_json, unpack
from megatron.rl.dataplane.store import FieldSpec


def test_pack_unpack_is_bitwise_for_every_supported_dtype_and_rank():
    g = torch.Generator().manual_seed(0)
    fields = {
        "tokens": [torch.randint(0, 50_000, (n,), generator=g) for n in (5, 0, 3)],
        "mask": [torch.rand(n, generator=g) > 0.5 for n in (4, 0, 2)],
        "logprobs": [torch.randn(n, generator=g) for n in (2, 1, 0)],
        "half": [torch.randn(n, generator=g).bfloat16() for n in (3, 3, 1)],
        "reward": [torch.randn((), generator=g, dtype=torch.float64) for _ in range(3)],
        "nan": [torch.tensor(float("nan")), torch.tensor(-0.0), torch.tensor(float("inf"))],
    }
    header, payload = pack(fields)
    assert payload.dtype == torch.uint8
    expected_bytes = sum(v.numel() * v.element_size() for vs in fields.values() for v in vs)
    assert payload.numel() == expected_bytes
    back = unpack(header, payload)
    assert list(back) == list(fields)
    for name, values in fields.items():
        for want, got in zip(values, back[name]):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            )


def test_unpacked_tensors_own_their_memory():
    header, payload = pack({"x": [torch.arange(4), torch.arange(2)]})
    back = unpack(header, payload)
    payload.zero_()
    assert back["x"][0].tolist() == [0, 1, 2, 3]


def test_no_keys_packs_to_nothing():
    header, payload = pack({"x": []})
    assert payload.numel() == 0 and unpack(header, payload) == {"x": []}


def test_a_payload_that_disagrees_with_its_header_raises():
    header, payload = pack({"x": [torch.arange(4)]})
    with pytest.raises(ValueError, match="payload has 40 bytes"):
        unpack(header, torch.cat([payload, torch.zeros(8, dtype=torch.uint8)]))


def test_unsupported_dtypes_are_refused_by_name():
    with pytest.raises(TypeError, match="complex64"):
        spec_to_json(FieldSpec(torch.complex64, 1))
