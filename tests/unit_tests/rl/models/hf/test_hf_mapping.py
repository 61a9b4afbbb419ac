"""Tensor layouts of the HF <-> megatron-core mapping, checked on tensors whose values name them."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from megatron.rl.models.architecture import GPTArchitecture
from megatron.rl.models.hf import (
    HFCheckpointError,
    hf_from_megatron,
    megatron_shard_from_hf,
    megatron_shard_readers,
)
from megatron.rl.models.hf.mapping import hf_tensor_shapes

HF_VOCAB = 10
ARCH = GPTArchitecture(
    num_layers=2,
    hidden_size=8,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=4,  # head_dim != hidden / heads
    ffn_hidden_size=6,
    vocab_size=12,  # HF_VOCAB padded
    max_position_embeddings=32,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    add_qkv_bias=True,
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
)
D, Q_PER_GROUP = 4, 2


class DictSource:
    """A ``TensorSource`` over in-memory tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of ``name`` or None."""
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """A slice of ``name`` along ``dim``."""
        stop = self.tensors[name].shape[dim] if stop is None else stop
        return self.tensors[name].narrow(dim, start, stop - start)


def hf_tensors(arch: GPTArchitecture = ARCH) -> dict[str, torch.Tensor]:
    """Every tensor distinct: tensor k holds k * 1000 + 0, 1, 2, ..."""
    shapes = hf_tensor_shapes(arch, HF_VOCAB)
    return {
        name: (k * 1000 + torch.arange(torch.Size(shape).numel(), dtype=torch.float32)).reshape(
            shape
        )
        for k, (name, shape) in enumerate(sorted(shapes.items()))
    }


def heads(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return t[first * D : (first + count) * D]


def test_qkv_rows_are_grouped_q_heads_then_k_then_v_per_query_group():
    hf = hf_tensors()
    out = megatron_shard_from_hf(ARCH, DictSource(hf), HF_VOCAB)
    attn = "model.layers.1.self_attn."
    for kind in ("weight", "bias"):
        q, k, v = (hf[attn + f"{p}_proj.{kind}"] for p in "qkv")
        expected = []
        for g in range(2):
            expected += [heads(q, g * Q_PER_GROUP, Q_PER_GROUP), heads(k, g, 1), heads(v, g, 1)]
        got = out[f"decoder.layers.1.self_attention.linear_qkv.{kind}"]
        assert torch.equal(got, torch.cat(expected)), kind
    fc1 = out["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1,
        torch.cat(
            [hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]
        ),
    )


def test_tp2_rank1_holds_its_groups_its_swiglu_halves_its_columns_and_padded_vocab_rows():
    hf = hf_tensors()
    out = megatron_shard_from_hf(ARCH, DictSource(hf), HF_VOCAB, tp_rank=1, tp_size=2)
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    q, k, v = (hf[attn + f"{p}_proj.weight"] for p in "qkv")
    qkv = out["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv, torch.cat([heads(q, 2, 2), heads(k, 1, 1), heads(v, 1, 1)]))
    fc1 = out["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1, torch.cat([hf[mlp + "gate_proj.weight"][3:], hf[mlp + "up_proj.weight"][3:]])
    )
    proj = out["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, hf[attn + "o_proj.weight"][:, 2 * D :])  # heads 2 and 3
    assert torch.equal(
        out["decoder.layers.0.mlp.linear_fc2.weight"], hf[mlp + "down_proj.weight"][:, 3:]
    )
    for name, source in (
        ("embedding.word_embeddings", "model.embed_tokens"),
        ("output_layer", "lm_head"),
    ):
        rows = out[f"{name}.weight"]  # vocab rows 6..11 of 12; HF has 10
        assert rows.shape == (6, 8)
        assert torch.equal(rows[:4], hf[f"{source}.weight"][6:]) and not rows[4:].any()
    assert torch.equal(
        out["decoder.layers.0.self_attention.q_layernorm.weight"], hf[attn + "q_norm.weight"]
    )
    assert torch.equal(
        out["decoder.layers.0.input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"]
    )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-names", "te-names"])
@pytest.mark.parametrize("biases", ["qkv", "all", "none"])
def test_round_trip_is_bitwise(tp, fused_norms, biases):
    arch = GPTArchitecture(
        **{
            **ARCH.__dict__,
            "add_qkv_bias": biases == "qkv",
            "add_bias_linear": biases == "all",
            "untie_embeddings_and_output_weights": biases != "none",
        }
    )
    hf = hf_tensors(arch)
    shards = [
        megatron_shard_from_hf(arch, DictSource(hf), HF_VOCAB, r, tp, fused_norms)
        for r in range(tp)
    ]
    norm = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert (norm in shards[0]) is fused_norms
    assert ("decoder.layers.0.mlp.linear_fc1.bias" in shards[0]) is (biases == "all")
    shards[0]["decoder.layers.0.mlp.linear_fc1._extra_state"] = None  # TE: ignored
    back = hf_from_megatron(arch, shards, HF_VOCAB)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_unknown_state_dict_entries_and_missing_ranks_tensors_are_errors():
    shard = megatron_shard_from_hf(ARCH, DictSource(hf_tensors()), HF_VOCAB)
    with pytest.raises(
        HFCheckpointError, match="no HF counterpart: .*'decoder.layers.0.extra.weight'"
    ):
        hf_from_megatron(
            ARCH, [{**shard, "decoder.layers.0.extra.weight": torch.zeros(1)}], HF_VOCAB
        )
    shard.pop("decoder.layers.1.mlp.linear_fc2.weight")
    with pytest.raises(
        HFCheckpointError, match="no tensor 'decoder.layers.1.mlp.linear_fc2.weight'"
    ):
        hf_from_megatron(ARCH, [shard], HF_VOCAB)


def test_tp_must_divide_the_query_groups():
    with pytest.raises(
        ValueError, match=r"num_query_groups: 2 is not divisible by tensor_model_parallel_size=4"
    ):
        megatron_shard_from_hf(ARCH, DictSource(hf_tensors()), HF_VOCAB, 0, 4)


class RecordingSource(DictSource):
    """A ``DictSource`` that records the tensor names it is asked for."""

    def __init__(self, tensors) -> None:
        super().__init__(tensors)
        self.reads: list[str] = []

    def read(self, name, dim=0, start=0, stop=None):
        self.reads.append(name)
        return super().read(name, dim, start, stop)


def test_readers_read_nothing_until_called_and_then_only_their_tensors():
    """The loader copies one converted tensor at a time: building the readers reads nothing, and
    each reader reads only the HF tensors of its megatron-core tensor."""
    hf = hf_tensors()
    source = RecordingSource(hf)
    readers = megatron_shard_readers(ARCH, source, HF_VOCAB, tp_rank=1, tp_size=2)
    assert source.reads == []
    qkv = readers["decoder.layers.1.self_attention.linear_qkv.bias"]()
    attn = "model.layers.1.self_attn."
    assert source.reads == [attn + f"{p}_proj.bias" for p in "qkv"]
    source.reads.clear()
    readers["decoder.layers.0.mlp.linear_fc1.weight"]()
    assert source.reads == [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
    whole = megatron_shard_from_hf(ARCH, DictSource(hf), HF_VOCAB, tp_rank=1, tp_size=2)
    assert whole.keys() == readers.keys()
    assert torch.equal(qkv, whole["decoder.layers.1.self_attention.linear_qkv.bias"])
