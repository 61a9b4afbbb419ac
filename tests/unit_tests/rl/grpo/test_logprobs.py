"""``token_logprobs`` on one rank (``tp_group=None``): real-vocab softmax, temperature, gradient."""

from __future__ import annotations

import torch

from megatron.rl.grpo.logprobs import token_logprobs


def random_inputs(b: int = 3, t: int = 4, v: int = 11, real: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * 3
    targets = torch.randint(0, real if real is not None else v, (b, t), generator=g)
    return logits, targets


def gather(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logp.gather(-1, targets[..., None]).squeeze(-1)


def test_equals_log_softmax_gather_without_padding():
    logits, targets = random_inputs()
    out = token_logprobs(logits, targets, vocab_size=logits.shape[-1])
    assert out.shape == targets.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, gather(torch.log_softmax(logits, -1), targets))


def test_padded_vocab_ids_get_no_probability_mass():
    logits, targets = random_inputs(v=16, real=13)
    logits[..., 13:] = 50.0  # huge padding logits must not steal mass from the real vocab
    out = token_logprobs(logits, targets, vocab_size=13)
    expected = gather(torch.log_softmax(logits[..., :13], -1), targets)
    torch.testing.assert_close(out, expected)
    # and the real-vocab probabilities sum to one
    all_ids = torch.arange(13).expand(3, 4, 13)
    probs = torch.stack([token_logprobs(logits, all_ids[..., i], 13).exp() for i in range(13)])
    torch.testing.assert_close(probs.sum(0), torch.ones(3, 4))


def test_target_in_padded_vocab_has_log_probability_minus_inf():
    logits, _ = random_inputs(b=1, t=1, v=8)
    out = token_logprobs(logits, torch.tensor([[7]]), vocab_size=6)
    assert out.item() == float("-inf")


def test_temperature_scales_each_row():
    logits, targets = random_inputs(b=3)
    temperature = torch.tensor([1.0, 0.5, 2.0])
    out = token_logprobs(logits, targets, logits.shape[-1], temperature)
    for b in range(3):
        ref = gather(torch.log_softmax(logits[b] / temperature[b], -1), targets[b])
        torch.testing.assert_close(out[b], ref)
    # rows really differ from the untempered values where the temperature is not 1
    plain = token_logprobs(logits, targets, logits.shape[-1])
    torch.testing.assert_close(out[0], plain[0])
    assert not torch.allclose(out[1], plain[1]) and not torch.allclose(out[2], plain[2])


def test_temperature_zero_is_treated_as_one():
    logits, targets = random_inputs(b=2)
    out = token_logprobs(logits, targets, logits.shape[-1], torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(out[0], gather(torch.log_softmax(logits[0], -1), targets[0]))
    torch.testing.assert_close(out[1], gather(torch.log_softmax(logits[1] / 0.5, -1), targets[1]))
    assert torch.isfinite(out).all()


def test_temperature_and_padding_combine():
    logits, targets = random_inputs(v=10, real=7)
    temperature = torch.tensor([0.7, 1.3, 0.0])
    out = token_logprobs(logits, targets, 7, temperature)
    t = torch.tensor([0.7, 1.3, 1.0])[:, None, None]
    torch.testing.assert_close(out, gather(torch.log_softmax(logits[..., :7] / t, -1), targets))


def test_gradient_matches_log_softmax_and_is_zero_on_padding():
    logits, targets = random_inputs(v=9, real=7)
    temperature = torch.tensor([1.0, 0.5, 2.0])
    x = logits.clone().requires_grad_()
    token_logprobs(x, targets, 7, temperature).sum().backward()
    y = logits[..., :7].clone().requires_grad_()
    gather(torch.log_softmax(y / temperature[:, None, None], -1), targets).sum().backward()
    torch.testing.assert_close(x.grad[..., :7], y.grad)
    assert torch.all(x.grad[..., 7:] == 0)
    assert x.grad.abs().sum() > 0


def test_half_precision_logits_give_float32_logprobs():
    logits, targets = random_inputs()
    out = token_logprobs(logits.to(torch.bfloat16), targets, logits.shape[-1])
    assert out.dtype == torch.float32
    ref = gather(torch.log_softmax(logits.to(torch.bfloat16).float(), -1), targets)
    torch.testing.assert_close(out, ref)
