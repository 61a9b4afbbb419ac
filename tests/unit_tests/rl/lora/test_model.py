"""LoRA on a megatron-core GPTModel: step 0 is the base, only adapters train, switching them off
gives the base, merging gives the same model, TP=2 equals TP=1."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import VOCAB, tiny_args, tiny_gpt

from megatron.rl.lora.config import PROJECTIONS, LoRAConfig
from megatron.rl.lora.frozen import store_frozen_linear_weights
from megatron.rl.lora.model import (
    BaseMismatchError,
    adapters_disabled,
    apply_lora,
    base_model,
    load_trainable_state_dict,
    lora_adapters,
    merged_state_dict,
    trainable_state_dict,
)
from megatron.trainer.config import optimizer_settings
from megatron.trainer.train.optimizer import build_optimizer

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    group_query_attention=True,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
)
CONFIG = LoRAConfig(rank=4, alpha=8.0, targets=PROJECTIONS, seed=5)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, 9), generator=g)  # (B, T)
    return ids, torch.arange(9)[None].expand(3, 9)


def logits(model, seed: int = 0) -> torch.Tensor:
    ids, positions = batch(seed)
    with torch.no_grad():
        return model.eval()(ids, positions, None)  # (B, T, V)


def randomize_b(model, seed: int = 1, std: float = 0.2) -> None:
    """B != 0: an adapter that has trained."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, adapter in lora_adapters(model).adapters():
            for b in adapter.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * std)


@pytest.mark.parametrize("overrides", [pytest.param({}, id="toy"), pytest.param(LLAMA, id="llama")])
def test_step_zero_is_the_base_model_exactly(single_rank_world, overrides):
    model = tiny_gpt(seed=3, **overrides)
    base = logits(model)
    apply_lora(model, CONFIG)
    assert torch.equal(logits(model), base)


def test_only_the_adapters_get_gradients_and_optimizer_state(single_rank_world):
    model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(model, CONFIG)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("lora.") for n in trained)
    ids, positions = batch()
    model.train()
    model(ids, positions, None).float().logsumexp(-1).mean().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trained
    optimizer, _ = build_optimizer(model, optimizer_settings(tiny_args(**LLAMA, min_lr=0.0)))
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    # per layer: q (4 x 32), k and v (2 groups x 8 = 16 rows each), o, gate, up, down
    rank, hidden, ffn = 4, 32, 64
    per_layer = 3 * rank * hidden + rank * (32 + 16 + 16)  # QKV: three A, three B
    per_layer += 2 * rank * hidden  # o_proj
    per_layer += 2 * rank * hidden + 2 * rank * ffn  # gate, up
    per_layer += rank * ffn + rank * hidden  # down
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * per_layer


def test_adapters_off_is_the_base_and_on_is_not(single_rank_world):
    model = tiny_gpt(seed=3, **LLAMA)
    base = logits(model)
    apply_lora(model, CONFIG)
    randomize_b(model)
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-2
    with adapters_disabled(model):
        assert torch.equal(logits(model), base)
    with base_model(model):  # the reference policy of a LoRA run
        assert torch.equal(logits(model), base)
    assert torch.equal(logits(model), adapted)  # back on after the block


def test_merged_weights_compute_what_base_plus_adapter_computes(single_rank_world):
    model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(model, CONFIG)
    randomize_b(model)
    merged = tiny_gpt(seed=4, **LLAMA)
    merged.load_state_dict(merged_state_dict(model))  # no adapter keys: a plain model
    torch.testing.assert_close(logits(merged), logits(model), atol=1e-5, rtol=1e-5)


def test_a_bf16_stored_base_merges_onto_its_original_values_in_float32(single_rank_world):
    """``merged_state_dict`` with the original base values (what ``--save-hf`` re-reads from the
    checkpoint): float32 ``W + scale * B @ A`` on the original ``W``, not on the bfloat16 copy
    the run stores; an original that does not round to the stored base is refused."""
    model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(model, CONFIG)
    randomize_b(model, std=1e-3)  # an update well below a bfloat16 step of the weights
    original = {
        k: v.clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.startswith("lora.")
    }
    exact = merged_state_dict(model)  # float32 base: the reference
    store_frozen_linear_weights(model, torch.bfloat16)
    readers = {k: (lambda v=v: v) for k, v in original.items()}
    merged = merged_state_dict(model, readers)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert merged[key].dtype == torch.float32
    for name in original:
        torch.testing.assert_close(merged[name], exact[name], atol=1e-7, rtol=0)
    rounded = merged_state_dict(model)[key]  # onto the stored bfloat16 base: not the policy
    assert (rounded - exact[key]).abs().max() > 1e-4
    readers[key] = lambda: original[key] + 0.01  # another base
    with pytest.raises(BaseMismatchError, match="linear_qkv.weight: the original base values"):
        merged_state_dict(model, readers)


def test_frozen_weights_stored_transposed_and_in_bf16_compute_the_same(single_rank_world):
    """The CPU tier's storage of a LoRA base: the (in, out) transpose, bf16 under autocast."""
    model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(model, CONFIG)
    randomize_b(model)
    ids, positions = batch()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        before = model.eval()(ids, positions, None)
    fp32 = logits(model)
    stored = store_frozen_linear_weights(model, torch.bfloat16)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert stored > 0 and qkv.dtype == torch.bfloat16 and qkv.t().is_contiguous()
    assert model.embedding.word_embeddings.weight.dtype == torch.float32  # a lookup, not a product
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        after = model.eval()(ids, positions, None)
    # autocast rounds float32 weights to these bfloat16 values anyway; only the GEMM's
    # accumulation over the other layout may round differently
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    fp32_model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(fp32_model, CONFIG)
    randomize_b(fp32_model)
    store_frozen_linear_weights(fp32_model)  # float32, transposed
    torch.testing.assert_close(logits(fp32_model), fp32, atol=1e-5, rtol=1e-5)


def bf16_logits(model) -> torch.Tensor:
    ids, positions = batch()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        return model.eval()(ids, positions, None).float()  # (B, T, V)


def test_under_bf16_autocast_a_small_update_changes_what_the_model_computes(single_rank_world):
    """The adapter's output is added to the bfloat16 product in float32: an update far below a
    bfloat16 step of the layer's outputs still moves the logits by what it moves them in float32
    (a bfloat16 sum rounds it to the product or a whole bfloat16 step away), and with the
    adapters off or B = 0 the model computes exactly the same (the reference is the policy at
    step 0)."""
    model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(model, CONFIG)
    store_frozen_linear_weights(model, torch.bfloat16)
    start = bf16_logits(model)
    with adapters_disabled(model):
        assert torch.equal(bf16_logits(model), start)
    fp32 = tiny_gpt(seed=3, **LLAMA)  # the same model, float32 throughout
    apply_lora(fp32, CONFIG)
    fp32_start = logits(fp32)
    randomize_b(model, std=1e-4)
    randomize_b(fp32, std=1e-4)
    moved_fp32 = (logits(fp32) - fp32_start).abs().mean()
    moved_bf16 = (bf16_logits(model) - start).abs().mean()
    assert moved_fp32 > 0 and 0.5 < float(moved_bf16 / moved_fp32) < 2.0


def test_adapter_state_loads_exactly_the_adapters(single_rank_world):
    model = tiny_gpt(seed=3, **LLAMA)
    apply_lora(model, CONFIG)
    randomize_b(model)
    state = {k: v.clone() for k, v in trainable_state_dict(model).items()}
    assert state and all(k.startswith("lora.") for k in state)
    other = tiny_gpt(seed=3, **LLAMA)
    apply_lora(other, CONFIG)
    load_trainable_state_dict(other, state)
    assert torch.equal(logits(other), logits(model))
    del state[next(iter(state))]
    with pytest.raises(ValueError, match="the adapters do not fit this model: missing"):
        load_trainable_state_dict(other, state)


def test_moe_mlps_take_no_adapters_but_their_attention_does(single_rank_world):
    moe = dict(num_experts=2, moe_router_topk=2, disable_bias_linear=True)
    with pytest.raises(ValueError, match="mixture-of-experts MLP"):
        apply_lora(tiny_gpt(seed=3, **moe), CONFIG)
    attention = LoRAConfig(rank=2, alpha=2.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    adapters = apply_lora(tiny_gpt(seed=3, **moe), attention)
    assert {name for _, name, _ in adapters.adapters()} == {"linear_qkv", "linear_proj"}


def adapted_on_rank(rank: int, world_size: int) -> dict:
    """Logits and adapter gradients of the same adapted model at TP = world_size (whole
    tensors: shards gathered)."""
    from grpo_testing.hf_models import full_logits

    from megatron.rl.lora.peft import gather_adapter_tensors

    model = tiny_gpt(tp=world_size, seed=3, **LLAMA)
    adapters = apply_lora(model, CONFIG)
    for layer, _, adapter in adapters.adapters():  # the same whole B at every layout
        for i, (name, b) in enumerate(adapter.lora_B.items()):
            rows = b.shape[0] * (world_size if adapter.layout.column else 1)
            g = torch.Generator().manual_seed(100 * layer + i)
            whole = torch.randn(rows, b.shape[1], generator=g) * 0.2
            local = b.shape[0]
            with torch.no_grad():
                b.copy_(
                    whole[rank * local : (rank + 1) * local] if adapter.layout.column else whole
                )
    ids, positions = batch()
    out = full_logits(model, ids, VOCAB)
    model.train()
    local = model(ids, positions, None).float()  # (B, T, V_padded / tp)
    # each rank's share of the mean over the whole vocabulary: their sum is the TP=1 loss
    (local.pow(2).sum() / (local.numel() * world_size)).backward()
    for _, _, adapter in adapters.adapters():  # gradients in place of the tensors, to gather
        with torch.no_grad():
            adapter.lora_A.copy_(adapter.lora_A.grad)
            for b in adapter.lora_B.values():
                b.copy_(b.grad)
    return {"logits": out, "grads": gather_adapter_tensors(adapters)}


def test_tensor_parallel_adapters_equal_one_rank():
    """Column-parallel layers split B's rows, row-parallel ones A's columns: at TP=2 the logits
    and every adapter gradient (gathered) are TP=1's."""
    (single,) = run_on_ranks(adapted_on_rank, 1)
    first, second = run_on_ranks(adapted_on_rank, 2)
    torch.testing.assert_close(first["logits"], single["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second["logits"], single["logits"], atol=1e-5, rtol=1e-5)
    assert single["grads"].keys() == first["grads"].keys() == second["grads"].keys()
    nonzero = 0
    for key, grad in single["grads"].items():
        torch.testing.assert_close(first["grads"][key], grad, atol=1e-6, rtol=1e-4, msg=key)
        torch.testing.assert_close(second["grads"][key], grad, atol=1e-6, rtol=1e-4, msg=key)
        nonzero += bool(grad.abs().max() > 0)
    assert nonzero == len(single["grads"])


class FusedNormLinear(torch.nn.Module):
    """What the adapter hook sees of Transformer Engine's ``LayerNormLinear`` (megatron-core's
    ``TELayerNormColumnParallelLinear``): the input norm's parameters on the linear layer, the
    un-normalized input, an (output, bias) result."""

    def __init__(self, normalization: str, zero_centered_gamma: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(6, 4, generator=g))
        self.layer_norm_weight = torch.nn.Parameter(torch.rand(4, generator=g) + 0.5)
        self.layer_norm_bias = torch.nn.Parameter(torch.randn(4, generator=g))
        self.normalization, self.zero_centered_gamma, self.eps = (
            normalization,
            zero_centered_gamma,
            1e-5,
        )

    def normed(self, x):
        w = self.layer_norm_weight + (1 if self.zero_centered_gamma else 0)
        if self.normalization == "RMSNorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * w + self.layer_norm_bias

    def forward(self, x):
        return self.normed(x) @ self.weight.t(), None


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered-gamma"])
def test_a_fused_norm_linear_layer_feeds_its_adapter_the_normalized_input(
    normalization, zero_centered
):
    from megatron.rl.lora.adapter import Layout, LinearAdapter
    from megatron.rl.lora.model import LoRAAdapters, _output_hook

    module = FusedNormLinear(normalization, zero_centered)
    layout = Layout("linear_fc1", (("gate_proj", 3), ("up_proj", 3)), 4, 0, 1)
    adapter = LinearAdapter(layout, ("gate_proj", "up_proj"), 2, 1.5, None)
    with torch.no_grad():
        adapter.lora_A.normal_(generator=torch.Generator().manual_seed(1))
        for b in adapter.lora_B.values():
            b.normal_(generator=torch.Generator().manual_seed(2))
    adapters = LoRAAdapters(LoRAConfig(rank=2, alpha=3.0))
    adapters.add(0, "linear_fc1", module, adapter)
    module.register_forward_hook(_output_hook(adapters, fused_norm=True))
    x = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(3))  # (s, b, hidden)
    out, _ = module(x)
    expected = module.normed(x) @ (module.weight + adapter.delta_weight()).t()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    adapters.active = False
    torch.testing.assert_close(module(x)[0], module.normed(x) @ module.weight.t())
