"""KV-cache correctness: cached, continuously batched decoding equals full recomputation."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import RowWork


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """(T, V) logits of a full forward over ``tokens`` (no cache)."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    return model(ids, torch.arange(len(tokens), device=device)[None], None)[0]


def make_cache(model, slots: int = 4, length: int = 32) -> KVCache:
    c = model.config
    device = next(model.parameters()).device
    return KVCache(
        c.num_layers, slots, length, c.num_query_groups, c.kv_channels, torch.float32, device
    )


@pytest.mark.parametrize("device", DEVICES)
def test_incremental_decoding_at_different_offsets_matches_full_forward(single_rank_world, device):
    model = tiny_gpt().to(device).eval()
    cache = make_cache(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 14)]
    prompts = [3, 1, 6]  # each sequence starts with a prompt of this length
    fed = [0, 0, 0]
    got: list[dict[int, torch.Tensor]] = [{}, {}, {}]
    # Step 0 prefills sequences 0 and 2; sequence 1 joins later (continuous batching).
    schedule = [[0, 2], [0, 2], [0, 1, 2], [1, 2], [0, 1, 2], [0, 1, 2], [1, 2], [2], [2]]
    for active in schedule:
        rows = []
        for s in active:
            n = prompts[s] if fed[s] == 0 else 1
            rows.append((s, seqs[s][fed[s] : fed[s] + n], fed[s]))
        width = max(len(t) for _, t, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (_, t, _) in enumerate(rows):
            ids[b, : len(t)] = torch.tensor(t)
        starts = torch.tensor([st for _, _, st in rows])
        lengths = torch.tensor([len(t) for _, t, _ in rows])
        positions = (starts[:, None] + torch.arange(width)).clamp(max=31)
        slots = torch.tensor([s for s, _, _ in rows])
        with cache.step(slots.to(device), starts.to(device), lengths.to(device)):
            out = model(ids.to(device), positions.to(device), None)
        for b, (s, t, st) in enumerate(rows):
            for j in range(len(t)):
                got[s][st + j] = out[b, j]
            fed[s] += len(t)

    for s, seq in enumerate(seqs):
        ref = full_logits(model, seq[: fed[s]])
        for pos, logits in got[s].items():
            torch.testing.assert_close(logits, ref[pos], atol=1e-5, rtol=1e-5)
        assert len(got[s]) == fed[s]


def test_training_attention_is_causal_softmax_attention(single_rank_world):
    model = tiny_gpt().eval()
    attention = model.decoder.layers[0].self_attention.core_attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 4, 8, generator=g) for _ in range(3))  # (s, b, h, d)
    out = attention(q, k, v, None)  # (s, b, h*d)

    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(5, 2, 32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention_through_the_cache_matches_repeated_heads():
    cache = KVCache(
        1, 2, 16, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu")
    )
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, 1, 4, 8, generator=g)  # 4 query heads share 2 kv heads
    k, v = torch.randn(6, 1, 2, 8, generator=g), torch.randn(6, 1, 2, 8, generator=g)
    with cache.step(torch.tensor([1]), torch.tensor([0]), torch.tensor([6])) as step:
        out = step.attend(0, q, k, v)
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kr) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vr).reshape(6, 1, 32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cache_rejects_a_step_past_its_length():
    cache = KVCache(1, 1, 8, 1, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="KV cache length 8"):
        with cache.step(torch.tensor([0]), torch.tensor([6]), torch.tensor([3])):
            pass


@pytest.mark.parametrize("device", DEVICES)
def test_runner_greedy_generation_matches_full_recompute(single_rank_world, device):
    model = tiny_gpt().to(device)
    runner = KVCacheRowRunner(model, make_cache(model), VOCAB)
    prompts = {0: [2, 5, 7], 1: [3], 2: [4, 4, 9, 10, 11]}
    seqs = {s: list(p) for s, p in prompts.items()}
    rows = [
        RowWork(s, tuple(p), 0, temperature=0.0, top_p=1.0, top_k=0, seed=s)
        for s, p in prompts.items()
    ]
    for _ in range(6):
        results = runner.run(rows)
        rows = []
        for res in results:
            seqs[res.slot].append(res.token)
            rows.append(RowWork(res.slot, (res.token,), len(seqs[res.slot]) - 1, 0.0, 1.0, 0, 0))

    for s, prompt in prompts.items():
        ref = list(prompt)
        for _ in range(6):
            logits = full_logits(model, ref)[-1, :VOCAB]  # padded ids are never sampled
            ref.append(int(logits.argmax()))
        assert seqs[s] == ref


class PaddingLovingModel(torch.nn.Module):
    """Logits that put almost all mass on the embedding-padding ids VOCAB.. of a 32-row table."""

    def forward(self, ids, positions, mask):
        logits = torch.zeros(*ids.shape, 32)
        logits[..., VOCAB:] = 1e4
        return logits


def test_runner_never_samples_padded_vocabulary_ids():
    cache = KVCache(1, 3, 8, 1, 4, torch.float32, torch.device("cpu"))
    runner = KVCacheRowRunner(PaddingLovingModel(), cache, VOCAB)
    rows = [
        RowWork(s, (2, 3), 0, temperature=t, top_p=1.0, top_k=0, seed=s)
        for s, t in enumerate([0.0, 1.0, 3.0])
    ]
    for res in runner.run(rows):
        assert 0 <= res.token < VOCAB
        assert res.logprob == pytest.approx(-math.log(VOCAB))


@pytest.mark.parametrize(
    "slots",
    [
        pytest.param([0, 1, 2, 3], id="consecutive-slots-view"),
        pytest.param([2, 0, 3, 1], id="scattered-slots-gather"),
    ],
)
def test_cached_logits_do_not_depend_on_slot_layout(single_rank_world, slots):
    """The consecutive-slot fast path (a view of the cache) and the gather give the same bits."""
    model = tiny_gpt().eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]

    def decode(slot_ids: list[int]) -> list[torch.Tensor]:
        cache = make_cache(model, slots=4, length=16)
        outs, tokens = [], [p[-1] for p in prompts]
        # prefill each prompt but its last token, then decode all four rows together
        for s, p in zip(slot_ids, prompts):
            with cache.step(torch.tensor([s]), torch.tensor([0]), torch.tensor([len(p) - 1])):
                model(torch.tensor([p[:-1]]), torch.arange(len(p) - 1)[None], None)
        starts = torch.tensor([len(p) - 1 for p in prompts])
        for _ in range(4):
            with cache.step(torch.tensor(slot_ids), starts, torch.ones(4, dtype=torch.long)):
                out = model(torch.tensor(tokens)[:, None], starts[:, None], None)[:, 0]  # (B, V)
            outs.append(out)
            tokens = out[:, :VOCAB].argmax(-1).tolist()
            starts = starts + 1
        return outs

    reference = decode([0, 1, 2, 3])
    for got, ref in zip(decode(slots), reference):
        assert torch.equal(got, ref)


def test_no_grad_forward_is_bitwise_the_autograd_forward(single_rank_world):
    """Linear layers skip megatron-core's autograd functions under no_grad: same values."""
    model = tiny_gpt().eval()
    ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(6)[None].expand(3, 6)
    with torch.enable_grad():
        with_grad = model(ids, positions, None)
    assert with_grad.requires_grad
    without = model(ids, positions, None)
    assert not without.requires_grad
    assert torch.equal(with_grad.detach(), without)


def test_slots_read_as_zeros_from_their_first_use():
    cache = KVCache(2, 8, 4, 1, 2, torch.float32, torch.device("cpu"))
    cache.keys.fill_(float("nan"))  # what an unwritten allocation may hold
    cache.values.fill_(float("nan"))
    one = torch.tensor([1])
    with cache.step(torch.tensor([2]), one, one):  # slot 2, context 2: slots 0..2, positions 0..1
        pass
    assert (cache.zeroed_slots, cache.zeroed_len) == (3, 2)
    # (layers, slots, H, S, D): what a step may read is as torch.zeros made it
    assert torch.equal(cache.keys[:, :3, :, :2], torch.zeros(2, 3, 1, 2, 2))
    assert torch.equal(cache.values[:, :3, :, :2], torch.zeros(2, 3, 1, 2, 2))
    assert cache.keys[:, 3:].isnan().all()  # never zeroed, never read
    assert cache.keys[:, :, :, 2:].isnan().all()  # past every context so far: never touched
    cache.keys[:, 0, :, :2] = 1.0  # a used slot keeps its contents when later steps zero more
    with cache.step(torch.tensor([0, 5]), torch.tensor([0, 2]), torch.tensor([1, 2])):
        pass  # slot 5 up to position 3: slots 3..5 and positions 2..3 of every slot used
    assert (cache.zeroed_slots, cache.zeroed_len) == (6, 4)
    assert (cache.keys[:, 0, :, :2] == 1.0).all()
    assert torch.equal(cache.keys[:, 0, :, 2:], torch.zeros(2, 1, 2, 2))
    assert torch.equal(cache.keys[:, 3:6], torch.zeros(2, 3, 1, 4, 2))
    assert cache.keys[:, 6:].isnan().all()


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_cpu_memory_follows_the_slots_in_use_not_the_slots_reserved():
    before = resident_mib()
    # 2 x 256 MiB reserved for 512 slots; one slot of 128 KiB per layer is used.
    cache = KVCache(2, 512, 128, 8, 64, torch.float32, torch.device("cpu"))
    one = torch.tensor([1])
    with cache.step(torch.tensor([0]), torch.tensor([127]), one):
        pass
    assert resident_mib() - before < 64
    del cache


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_cpu_memory_follows_the_contexts_in_use_not_the_length_reserved():
    before = resident_mib()
    # 2 x 256 MiB reserved for 64 slots of 1024 positions; 64 contexts of 16 positions are used
    # (each head's 16 x 64 float32 keys: one page of the slot's 64 x 4 KiB pages per head).
    cache = KVCache(2, 64, 1024, 8, 64, torch.float32, torch.device("cpu"))
    sixteen = torch.full((64,), 16)
    with cache.step(torch.arange(64), torch.zeros(64, dtype=torch.long), sixteen):
        pass
    assert resident_mib() - before < 64
    del cache


RELEASE_PROBE = """
import os, torch
from megatron.rl.inference.cpu.kv_cache import KVCache

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

cache = KVCache(2, 128, 128, 8, 64, torch.float32, torch.device("cpu"))  # 2 x 64 MiB
before = resident_mib()
with cache.step(torch.arange(128), torch.full((128,), 127), torch.ones(128)):
    pass  # every slot zeroed over all its 128 positions: resident
cache.keys[:, 0] = 1.0
used = resident_mib() - before
cache.release()
released = resident_mib() - before
with cache.step(torch.tensor([0]), torch.tensor([0]), torch.tensor([1])):
    pass
print(used, released, cache.zeroed_slots, bool((cache.keys[:, 0] == 0).all()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_release_returns_the_used_slots_memory_and_they_read_as_zeros_again():
    """In a fresh process: what earlier tests freed into this one's heap would be resident
    already and hide the cache's own pages."""
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    used, released, zeroed, zeros = float(out[0]), float(out[1]), int(out[2]), out[3] == "True"
    assert used > 96 and released < 16  # 128 MiB touched, then handed back
    assert zeroed == 1 and zeros  # slot 0 reused: zeroed again on its first use


def test_an_idle_window_end_releases_the_cache_and_generation_is_unchanged(single_rank_world):
    model = tiny_gpt()
    shape = dict(num_layers=2, num_slots=4, max_seq_len=16, num_kv_heads=4, head_dim=8)
    cache = KVCache(**shape, dtype=torch.float32, device=torch.device("cpu"))
    runner = KVCacheRowRunner(model, cache, VOCAB)
    rows = [RowWork(0, (3, 4, 5), 0, 1.0, 1.0, 0, seed=1)]
    first = runner.run(rows)
    keys = cache.keys
    runner.end_window(idle=False)  # a request in flight keeps its keys
    assert cache.keys is keys and cache.zeroed_slots == 1
    runner.end_window(idle=True)
    assert cache.keys is not keys and cache.zeroed_slots == 0
    assert runner.run(rows) == first  # a new request on the released cache: the same
