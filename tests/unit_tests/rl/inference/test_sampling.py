"""``sample_tokens``: greedy, top-k/top-p truncation, per-row independence and exact frequencies.

Frequencies are measured over a deterministic grid of uniforms ``(arange(N) + 0.5) / N``, so an
inverse-CDF sampler reproduces every token's probability to within about 1/N.
"""

from __future__ import annotations

import pytest
import torch

from megatron.rl.inference.sampling import (
    sample_tokens,
    sample_with_alternatives,
    sort_descending_stable,
    top_alternatives,
)

N = 20_000
GRID = (torch.arange(N, dtype=torch.float64) + 0.5) / N
LAST_U = 1.0 - 2.0**-24  # largest float32 below 1


def rows(b: int, v: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2


def full(b: int, value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((b,), value, dtype=dtype)


def frequencies(logits_row, temperature=1.0, top_p=1.0, top_k=0) -> torch.Tensor:
    """Empirical distribution of the tokens sampled over the uniform grid."""
    tokens, _ = sample_tokens(
        logits_row.expand(N, -1),
        full(N, temperature),
        full(N, top_p),
        full(N, top_k, torch.long),
        GRID.float(),
    )
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).double() / N


def test_greedy_rows_pick_argmax_and_report_temperature_one_logprob():
    logits = rows(6)
    uniforms = torch.tensor([0.0, 0.1, 0.5, 0.9, 0.99, LAST_U])
    tokens, logprobs = sample_tokens(
        logits, full(6, 0.0), full(6, 1.0), full(6, 0, torch.long), uniforms
    )
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32


def test_greedy_ignores_top_k_and_top_p():
    logits = rows(4)
    tokens, _ = sample_tokens(
        logits, full(4, 0.0), full(4, 0.3), full(4, 3, torch.long), torch.tensor([0.9] * 4)
    )
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_one_equals_greedy(temperature):
    logits = rows(8, seed=1)
    uniforms = torch.linspace(0, LAST_U, 8)
    tokens, logprobs = sample_tokens(
        logits, full(8, temperature), full(8, 1.0), full(8, 1, torch.long), uniforms
    )
    assert tokens.tolist() == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, ref)


def test_tiny_top_p_keeps_only_the_top_token():
    logits = rows(8, seed=2)
    uniforms = torch.linspace(0, LAST_U, 8)
    tokens, _ = sample_tokens(logits, full(8, 1.5), full(8, 1e-6), full(8, 0, torch.long), uniforms)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_minus_inf_logits_are_never_sampled():
    logits = rows(1, v=8, seed=3)
    banned = [0, 3, 7]
    logits[0, banned] = float("-inf")
    for temperature in (0.3, 1.0, 5.0):
        freq = frequencies(logits[0], temperature)
        assert freq[banned].sum() == 0
    edges = torch.tensor([0.0, LAST_U])
    tokens, logprobs = sample_tokens(
        logits.expand(2, -1), full(2, 100.0), full(2, 1.0), full(2, 0, torch.long), edges
    )
    assert not set(tokens.tolist()) & set(banned)
    assert torch.isfinite(logprobs).all()


def test_minus_inf_after_top_k_with_larger_k_than_allowed_tokens():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), float("-inf")]])
    freq = frequencies(logits[0], top_k=4)
    assert freq[[1, 3, 4]].sum() == 0
    p = torch.softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), 0)
    torch.testing.assert_close(freq[[0, 2]], p, atol=2e-3, rtol=0)


def test_row_result_does_not_depend_on_other_rows():
    target = rows(1, seed=4)
    for u in (0.05, 0.37, 0.81, LAST_U):
        for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 4)]:
            alone, alone_lp = sample_tokens(
                target,
                full(1, temperature),
                full(1, top_p),
                full(1, top_k, torch.long),
                torch.tensor([u]),
            )
            others = rows(5, seed=int(u * 1000))
            logits = torch.cat([others[:2], target, others[2:]])
            g = torch.Generator().manual_seed(5)
            temps = torch.rand(6, generator=g) * 2
            top_ps = torch.rand(6, generator=g) * 0.9 + 0.1
            top_ks = torch.randint(0, 5, (6,), generator=g)
            uniforms = torch.rand(6, generator=g)
            temps[2], top_ps[2], top_ks[2], uniforms[2] = temperature, top_p, top_k, u
            batched, batched_lp = sample_tokens(logits, temps, top_ps, top_ks, uniforms)
            assert batched[2] == alone[0]
            torch.testing.assert_close(batched_lp[2], alone_lp[0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_tempered_softmax(temperature):
    logits = rows(1, v=7, seed=6)[0]
    expected = torch.softmax(logits.double() / temperature, -1)
    torch.testing.assert_close(frequencies(logits, temperature), expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
def test_frequencies_match_renormalized_top_k(top_k):
    logits = rows(1, v=7, seed=7)[0]
    p = torch.softmax(logits.double() / 0.8, -1)
    keep = torch.zeros(7, dtype=torch.bool)
    keep[p.topk(top_k).indices] = True
    expected = torch.where(keep, p, 0.0) / p[keep].sum()
    torch.testing.assert_close(frequencies(logits, 0.8, top_k=top_k), expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    "top_p, expected",
    [
        # probabilities 0.5, 0.3, 0.15, 0.05 (tokens 2, 0, 3, 1): the nucleus is the smallest set
        # of most likely tokens whose mass reaches top_p
        pytest.param(0.4, [0.0, 0.0, 1.0, 0.0], id="top-token-only"),
        pytest.param(0.7, [0.3 / 0.8, 0.0, 0.5 / 0.8, 0.0], id="two-tokens"),
        pytest.param(0.85, [0.3 / 0.95, 0.0, 0.5 / 0.95, 0.15 / 0.95], id="three-tokens"),
        pytest.param(1.0, [0.3, 0.05, 0.5, 0.15], id="disabled"),
    ],
)
def test_frequencies_match_renormalized_top_p(top_p, expected):
    logits = torch.log(torch.tensor([0.3, 0.05, 0.5, 0.15]))
    freq = frequencies(logits, top_p=top_p)
    torch.testing.assert_close(freq, torch.tensor(expected, dtype=torch.float64), atol=2e-3, rtol=0)


def test_top_k_and_top_p_combine():
    logits = torch.log(torch.tensor([0.3, 0.05, 0.5, 0.15]))
    # top_k=3 keeps {2, 0, 3}; top_p=0.7 then keeps {2, 0}
    freq = frequencies(logits, top_p=0.7, top_k=3)
    torch.testing.assert_close(
        freq, torch.tensor([0.375, 0.0, 0.625, 0.0], dtype=torch.float64), atol=2e-3, rtol=0
    )


def test_returned_logprob_is_untruncated_tempered_log_softmax():
    logits = rows(64, seed=8)
    g = torch.Generator().manual_seed(9)
    temps = torch.rand(64, generator=g) * 2 + 0.1
    top_ps = torch.rand(64, generator=g) * 0.9 + 0.1
    top_ks = torch.randint(0, 5, (64,), generator=g)
    tokens, logprobs = sample_tokens(logits, temps, top_ps, top_ks, torch.rand(64, generator=g))
    ref = torch.log_softmax(logits / temps[:, None], -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, ref)


@pytest.mark.parametrize(
    "top_k, top_p, uniform, token, prob",
    [
        # renormalized over {2, 0} the top token would have 0.625, but the report is 0.5
        pytest.param(2, 1.0, 0.1, 2, 0.5, id="top-k-2-first"),
        pytest.param(2, 1.0, 0.9, 0, 0.3, id="top-k-2-second"),
        pytest.param(0, 0.7, 0.9, 0, 0.3, id="top-p-0.7-second"),
        pytest.param(0, 1.0, 0.99, 1, 0.05, id="untruncated-least-likely"),
    ],
)
def test_logprob_of_truncated_sample_is_not_renormalized(top_k, top_p, uniform, token, prob):
    logits = torch.log(torch.tensor([[0.3, 0.05, 0.5, 0.15]]))
    tokens, logprobs = sample_tokens(
        logits, full(1, 1.0), full(1, top_p), full(1, top_k, torch.long), torch.tensor([uniform])
    )
    assert tokens.item() == token
    assert logprobs.item() == pytest.approx(torch.log(torch.tensor(prob)).item(), abs=1e-5)


def test_larger_uniform_never_picks_a_more_likely_token():
    """Inverse CDF over tokens sorted by probability: token rank is monotone in the uniform."""
    logits = rows(1, v=9, seed=10)[0]
    tokens, _ = sample_tokens(
        logits.expand(N, -1), full(N, 1.0), full(N, 1.0), full(N, 0, torch.long), GRID.float()
    )
    order = torch.argsort(logits, descending=True)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(9)
    ranks = rank_of[tokens]
    assert torch.all(ranks[1:] >= ranks[:-1])
    assert ranks[0] == 0 and ranks[-1] == 8


def test_uniform_intervals_are_half_open_over_equally_likely_tokens():
    """Token k owns exactly the uniforms in [k/4, (k+1)/4); ties keep the lower id first."""
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.75, LAST_U])
    tokens, logprobs = sample_tokens(
        torch.zeros(7, 4), full(7, 1.0), full(7, 1.0), full(7, 0, torch.long), uniforms
    )
    assert tokens.tolist() == [0, 0, 1, 1, 2, 3, 3]
    torch.testing.assert_close(logprobs, torch.full((7,), -torch.log(torch.tensor(4.0)).item()))


@pytest.mark.parametrize(
    "width",
    [
        pytest.param(7, id="tiny"),
        pytest.param(320, id="toy-vocab"),
        pytest.param(4097, id="odd-width"),
        pytest.param(151936, id="qwen-vocab"),
    ],
)
def test_fast_descending_sort_is_torchs_stable_sort(width):
    """Ties keep index order, -0.0 ties with 0.0, -inf sorts last: the same values and order."""
    g = torch.Generator().manual_seed(width)
    x = torch.log_softmax(torch.randn(6, width, generator=g) * 4, -1)
    x[:, width // 2 :] = float("-inf")
    x[:, 1] = x[:, 3]  # an exact tie
    x[:, 0], x[:, 2] = 0.0, -0.0
    x[0, 5] = 1.5
    want_values, want_order = torch.sort(x, dim=-1, descending=True, stable=True)
    values, order = sort_descending_stable(x)
    assert torch.equal(order, want_order)
    assert torch.equal(values, want_values)


@pytest.mark.parametrize(
    "row, n, ids",
    [
        pytest.param([0.1, 0.5, 0.2, 0.5], 2, [1, 3], id="tie-lower-id-first"),
        pytest.param([0.1, 0.5, 0.2, 0.4], 3, [1, 3, 2], id="most-likely-first"),
        pytest.param([0.3, 0.1], 5, [0, 1], id="more-than-the-vocabulary"),
        pytest.param([0.3, 0.1], 0, [], id="none"),
    ],
)
def test_alternatives_are_the_largest_entries_themselves(row, n, ids):
    logprobs = torch.log(torch.tensor([row]))  # (1, V)
    top_ids, top_values = top_alternatives(logprobs, n)
    assert top_ids.tolist() == [ids]
    assert top_values.tolist() == [[logprobs[0, i].item() for i in ids]]  # no recomputation


def test_sampled_tokens_and_alternatives_share_one_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    temperature = torch.tensor([0.0, 0.7, 1.3])
    args = (temperature, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.rand(3))
    tokens, logprobs, top_ids, top_values = sample_with_alternatives(logits, *args, top_n=50)
    plain_tokens, plain_logprobs = sample_tokens(logits, *args)
    assert torch.equal(tokens, plain_tokens) and torch.equal(logprobs, plain_logprobs)
    for b in range(3):  # every token's logprob is bitwise its entry among the alternatives
        where = top_ids[b].tolist().index(int(tokens[b]))
        assert top_values[b, where].item() == logprobs[b].item()
    assert top_ids[0, 0] == tokens[0]  # greedy: the most likely
