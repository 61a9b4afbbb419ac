"""The engine's plain-torch forward (``CachedForward``) computes what the model's modules compute."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_gpt
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron.rl.inference.cpu.cached_forward import CachedForward, TransposedWeights, _Rotary
from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import RowWork

ROPE = dict(position_embedding_type="rope", normalization="RMSNorm")
ARCHITECTURES = [
    pytest.param({}, id="toy-layernorm-gelu-bias-learned-positions-tied"),
    pytest.param(
        dict(
            **ROPE,
            swiglu=True,
            disable_bias_linear=True,
            untie_embeddings_and_output_weights=True,
            group_query_attention=True,
            num_query_groups=2,
        ),
        id="llama-rmsnorm-swiglu-rope-gqa-untied",
    ),
    pytest.param(
        dict(**ROPE, swiglu=True, disable_bias_linear=True, add_qkv_bias=True),
        id="qwen2-qkv-bias",
    ),
    pytest.param(
        dict(**ROPE, swiglu=True, disable_bias_linear=True, qk_layernorm=True, kv_channels=16),
        id="qwen3-qk-norm-wide-heads",
    ),
    pytest.param(dict(**ROPE, rotary_percent=0.5), id="partial-rotary"),
]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (megatron-core starts biases at zero, which would hide them)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def make_cache(model, slots: int = 4, length: int = 24) -> KVCache:
    c = model.config
    shape = (c.num_layers, slots, length, c.num_query_groups, c.kv_channels)
    return KVCache(*shape, torch.float32, torch.device("cpu"))


def rows_of(prompts, starts, tokens=None) -> list[RowWork]:
    new = [tuple(p) for p in prompts] if tokens is None else [(t,) for t in tokens]
    return [RowWork(i, new[i], starts[i], 1.0, 1.0, 0, seed=i) for i in range(len(prompts))]


def assert_same_generation(a: list, b: list) -> None:
    """The same tokens; logprobs equal up to float rounding (the GEMM kernels differ)."""
    assert [[t for t, _ in step] for step in a] == [[t for t, _ in step] for step in b]
    for step_a, step_b in zip(a, b):
        for (_, x), (_, y) in zip(step_a, step_b):
            assert abs(x - y) <= 1e-5


def generate(runner: KVCacheRowRunner, prompts: list[list[int]], steps: int) -> list:
    """Prefill, then ``steps`` decode steps; every row's (token, logprob)."""
    results = runner.run(rows_of(prompts, [0] * len(prompts)))
    out = [[(r.token, r.logprob) for r in results]]
    starts = [len(p) for p in prompts]
    for _ in range(steps):
        results = runner.run(rows_of(prompts, starts, [r.token for r in results]))
        out.append([(r.token, r.logprob) for r in results])
        starts = [s + 1 for s in starts]
    return out


@pytest.mark.parametrize("overrides", ARCHITECTURES)
def test_engine_steps_compute_what_the_model_modules_compute(single_rank_world, overrides):
    """Prefill of uneven prompts, then decoding: the same tokens, the same logprobs."""
    model = randomized(tiny_gpt(**overrides))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 8, 3)]
    fast = KVCacheRowRunner(model, make_cache(model), VOCAB)
    modules = KVCacheRowRunner(model, make_cache(model), VOCAB)
    assert fast.cached_forward is not None
    modules.cached_forward = None  # the model's own forward
    assert_same_generation(generate(fast, prompts, 10), generate(modules, prompts, 10))


@pytest.mark.parametrize("overrides", ARCHITECTURES[:2])
def test_engine_logits_match_a_full_forward_without_cache(single_rank_world, overrides):
    model = randomized(tiny_gpt(**overrides))
    tokens = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    forward = CachedForward.of(model)
    cache = make_cache(model, slots=1)
    got = []
    for t, start, n in ((tokens[:6], 0, 6), (tokens[6:7], 6, 1), (tokens[7:8], 7, 1)):
        with cache.step(torch.tensor([0]), torch.tensor([start]), torch.tensor([n])) as step:
            ids, positions = torch.tensor([t]), torch.arange(start, start + n)[None]
            got.append(forward(ids, positions, step)[0])
    full = model(torch.tensor([tokens[:8]]), torch.arange(8)[None], None)[0]  # (T, V)
    for logits, position in zip(got, (5, 6, 7)):
        torch.testing.assert_close(logits, full[position], atol=1e-5, rtol=1e-5)


def test_a_weight_changed_in_place_inside_a_window_is_used_at_once(single_rank_world):
    """The forward keeps transposed copies of the weights; an optimizer-style in-place update
    (version counter) makes it copy again, and ``end_window`` drops every copy."""
    model = randomized(tiny_gpt())
    fast = KVCacheRowRunner(model, make_cache(model), VOCAB)
    modules = KVCacheRowRunner(model, make_cache(model), VOCAB)
    modules.cached_forward = None
    prompts = [[3, 4, 5], [6, 7]]
    assert_same_generation(generate(fast, prompts, 2), generate(modules, prompts, 2))
    layer = model.decoder.layers[0].mlp.linear_fc1
    layer.weight.mul_(-1.5)  # in place, as an optimizer step
    assert_same_generation(generate(fast, prompts, 2), generate(modules, prompts, 2))
    fast.end_window()
    assert not fast.cached_forward.transposed._copies
    layer.weight.data = layer.weight.data * 0.5  # new storage
    assert_same_generation(generate(fast, prompts, 2), generate(modules, prompts, 2))


def test_transposed_weights_are_copies_until_the_weight_changes():
    w = torch.nn.Parameter(torch.randn(3, 5))
    cache = TransposedWeights()
    first = cache(w)
    assert first.is_contiguous() and torch.equal(first, w.t())
    assert cache(w) is first
    with torch.no_grad():
        w.add_(1.0)
    second = cache(w)
    assert second is not first and torch.equal(second, w.t())
    cache.clear()
    assert cache(w) is not second


def test_models_it_does_not_reproduce_run_their_own_forward(single_rank_world):
    model = tiny_gpt()
    model.config.fp32_residual_connection = True  # a setting the plain program does not have
    assert CachedForward.of(model) is None
    assert CachedForward.of(torch.nn.Linear(2, 2)) is None
    runner = KVCacheRowRunner(model, make_cache(model), VOCAB)
    assert runner.cached_forward is None
    model.config.fp32_residual_connection = False


@pytest.mark.parametrize(
    "heads, kv_heads",
    [pytest.param(4, 4, id="multi-head"), pytest.param(4, 2, id="grouped-query")],
)
def test_one_token_steps_attend_like_softmax_attention_over_the_cache(heads, kv_heads):
    """The decode path (batched matmuls over the cache) against a reference computed by hand,
    rows at different lengths and on scattered slots."""
    d = 8
    cache = KVCache(1, 3, 16, kv_heads, d, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    lengths = [5, 2, 7]
    keys = [torch.randn(n, kv_heads, d, generator=g) for n in lengths]
    values = [torch.randn(n, kv_heads, d, generator=g) for n in lengths]
    slots = [2, 0, 1]
    for s, k, v in zip(slots, keys, values):  # earlier tokens, written by a prefill step
        q = torch.randn(len(k), 1, heads, d, generator=g)
        with cache.step(torch.tensor([s]), torch.tensor([0]), torch.tensor([len(k)])) as step:
            step.attend(0, q, k[:, None], v[:, None])
    q = torch.randn(1, 3, heads, d, generator=g)
    k_new, v_new = torch.randn(1, 3, kv_heads, d, generator=g), torch.randn(1, 3, kv_heads, d)
    one = torch.ones(3, dtype=torch.long)
    with cache.step(torch.tensor(slots), torch.tensor(lengths), one) as step:
        out = step.attend(0, q, k_new, v_new)  # (1, B, H*d)
    for b in range(3):
        k = torch.cat([keys[b], k_new[0, b][None]]).repeat_interleave(heads // kv_heads, dim=1)
        v = torch.cat([values[b], v_new[0, b][None]]).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[0, b], k) / math.sqrt(d)
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(heads * d)
        torch.testing.assert_close(out[0, b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", ARCHITECTURES[:2])
def test_a_step_mixing_prefill_and_decode_rows_is_one_packed_pass(single_rank_world, overrides):
    """Continuous batching: requests join while others decode; one packed pass gives what the
    modules give running the one-token rows and the prompt rows as two padded forwards."""
    model = randomized(tiny_gpt(**overrides))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (4, 7, 1, 3)]
    joins = [0, 0, 2, 3]  # the step at which each request arrives

    def run(runner: KVCacheRowRunner) -> list:
        fed, last, out = [0] * 4, [None] * 4, []
        for step in range(7):
            rows = []
            for i, p in enumerate(prompts):
                if step < joins[i]:
                    continue
                tokens = tuple(p) if fed[i] == 0 else (last[i],)
                rows.append(RowWork(i, tokens, fed[i], 1.0, 1.0, 0, seed=i))
            results = runner.run(rows)
            for row, r in zip(rows, results):
                fed[row.slot] += len(row.tokens)
                last[row.slot] = r.token
            out.append([(r.token, r.logprob) for r in results])
        return out

    fast = KVCacheRowRunner(model, make_cache(model), VOCAB)
    modules = KVCacheRowRunner(model, make_cache(model), VOCAB)
    modules.cached_forward = None
    assert_same_generation(run(fast), run(modules))


@pytest.mark.parametrize("rot_dim", [pytest.param(16, id="full"), pytest.param(8, id="partial")])
def test_one_rotation_of_a_groups_queries_and_key_equals_megatron_cores_rope_bitwise(rot_dim):
    """The engine rotates each group's query heads and key in one pass, the half swap a roll with
    the sign folded into the table: the same values as megatron-core's unfused RoPE applied to the
    queries and the keys apart."""
    torch.manual_seed(0)
    count, groups, per_group, d = 5, 2, 3, 16
    angles = torch.randn(count, rot_dim) * 10  # (N, d_rot)
    mixed = torch.randn(count, 1, groups, per_group + 2, d)  # per group: queries, key, value
    both = _Rotary.of(angles, torch.float32).apply(mixed[:, :, :, : per_group + 1])
    freqs = angles[:, None, None, :]  # (N, 1, 1, d_rot): megatron-core's [s, b, h, d] table
    query = mixed[:, :, :, :per_group].reshape(count, 1, groups * per_group, d)
    expected_query = _apply_rotary_pos_emb_bshd(query, freqs)
    expected_key = _apply_rotary_pos_emb_bshd(mixed[:, :, :, per_group], freqs)
    assert torch.equal(both[:, :, :, :per_group].reshape(count, 1, -1, d), expected_query)
    assert torch.equal(both[:, :, :, per_group], expected_key)


def test_a_groups_identical_prompts_are_prefilled_once_with_the_same_results(
    single_rank_world, monkeypatch
):
    """Samples of one prompt (GRPO's group) prefill once; the others copy the keys, values and
    logits, then sample with their own seeds: what each would have computed alone."""
    from megatron.rl.inference.cpu import kv_cache_runner

    model = randomized(tiny_gpt(**ARCHITECTURES[1].values[0]))
    prompts = [[3, 4, 5, 6], [3, 4, 5, 6], [7, 8], [3, 4, 5, 6], [7, 8], [9]]
    assert kv_cache_runner.shared_prompts(rows_of(prompts, [0] * 6)) == (
        [0, 2, 5],
        [0, 0, 1, 0, 1, 2],
    )
    shared = KVCacheRowRunner(model, make_cache(model, slots=6), VOCAB)
    runs = []
    forwards = []
    original = KVCacheRowRunner._forward_last_logits

    def counted(self, rows):
        forwards.append(len(rows))
        return original(self, rows)

    monkeypatch.setattr(KVCacheRowRunner, "_forward_last_logits", counted)
    runs.append(generate(shared, prompts, 4))
    assert forwards[0] == 3  # one row per distinct prompt
    monkeypatch.setattr(
        kv_cache_runner, "shared_prompts", lambda rows: (list(range(len(rows))),) * 2
    )
    alone = KVCacheRowRunner(model, make_cache(model, slots=6), VOCAB)
    runs.append(generate(alone, prompts, 4))
    # The same tokens; logprobs equal up to the GEMM's rounding, which may depend on how many
    # rows a product has (bitwise on Intel's AMX kernels, 2e-7 apart on an AMD EPYC's)
    assert_same_generation(runs[0], runs[1])
    assert len({tuple(t for t, _ in step[:2]) for step in runs[0][1:]}) > 1  # own seeds
