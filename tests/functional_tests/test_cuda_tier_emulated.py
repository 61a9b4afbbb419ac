"""The training loop on the CUDA tier, emulated on the CPU, against the CPU tier.

``grpo_testing/emulated_cuda_train.py`` runs ``pretrain_grpo.py``'s loop with ``CUDATier``:
megatron-core ``DistributedDataParallel``, ``get_megatron_optimizer`` (also bf16 and the distributed
optimizer), ``get_forward_backward_func`` (also the 1F1B pipeline schedule), rollouts from
megatron-core's ``DynamicInferenceEngine`` with the ``flash_reference`` attention and
``dist_checkpointing`` save/resume, all on a CPU-only torch (``grpo_testing/emulated_cuda.py``).
Without a GPU this is what shows that the tier is wired into the loop and computes what the CPU tier
computes; the ``gpu`` tests in ``test_cuda_tier.py`` run the real thing.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from golden_values import (
    ROOT,
    TOLERANCES,
    checkpoint_of_iteration,
    run_training,
    subprocess_env,
)

EMULATED = "tests/grpo_testing/emulated_cuda_train.py"
POLICY = "tests/grpo_testing/emulated_cuda_policy.py"
BASE = {"train-iters": 3, "lr-warmup-iters": 1, "seed": 1234}
SAME = {"reward_mean": 1e-9, "reward_std": 1e-9, "loss": 1e-4, "grad_norm": 1e-5}
"""Metric -> relative tolerance between the tiers (rewards: the same tokens; the rest: float
rounding of megatron-core's fused/bucketed gradient path vs the CPU tier's)."""
SAME_ABS = 1e-6
"""Absolute tolerance beside it: at lag 0 the GRPO loss is a sum of O(1) terms that cancels to
about 0 (zero-mean advantages, ratio 1), so what is left is float32 rounding of that sum, which
differs with the CPU's kernels (1.2e-7 between the tiers on an AVX2-only CPU); a real mismatch
is orders of magnitude larger."""


def assert_same_run(cpu: list[dict], cuda: list[dict]) -> None:
    steps = [m["step"] for m in cpu]
    assert [m["step"] for m in cuda] == steps == list(range(len(steps))) and len(steps) >= 3
    for a, b in zip(cpu, cuda):
        for metric, rel in SAME.items():
            assert b[metric] == pytest.approx(a[metric], rel=rel, abs=SAME_ABS), (a["step"], metric)
        for metric in ("staleness_max", "token_staleness_mean", "lr"):
            assert b[metric] == a[metric], (a["step"], metric)


SAVE_LAST = {"save-interval": BASE["train-iters"]}
"""Save the last iteration only (the reference model of the ``--ref-load`` test)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Where the synchronous one-process runs save: ``cpu/`` and ``cuda/``."""
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def cpu_runs(saved):
    """Forced lag -> the CPU tier's run; the lag-0 run saves its last iteration to ``saved``."""
    return {
        0: run_training(1, {**BASE, "rl-forced-lag": 0, "save": saved / "cpu", **SAVE_LAST}),
        1: run_training(1, {**BASE, "rl-forced-lag": 1}),
    }


@pytest.fixture(scope="module")
def cuda_run(saved):
    """The CUDA tier's synchronous one-process run; it saves its last iteration to ``saved``."""
    args = {**BASE, "rl-forced-lag": 0, "save": saved / "cuda", **SAVE_LAST}
    return run_training(1, args, script=EMULATED)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        pytest.param(1, {}, id="one-process"),
        pytest.param(2, {"tensor-model-parallel-size": 2}, id="tp2"),
        pytest.param(2, {}, id="dp2"),
    ],
)
def test_synchronous_runs_match_the_cpu_tier(cpu_runs, cuda_run, nproc, layout):
    if nproc == 1:
        cuda = cuda_run
    else:
        cuda = run_training(nproc, {**BASE, "rl-forced-lag": 0, **layout}, script=EMULATED)
    assert_same_run(cpu_runs[0], cuda)


def kv_cache_mode(mode: str):
    """``mode`` as a test parameter, skipped where megatron-core does not offer it."""
    from megatron.rl.inference.megatron_core.compat import KV_CACHE_MODES

    missing = pytest.mark.skip(reason=f"this megatron-core has no {mode!r} KV-cache mode")
    return pytest.param(mode, id=mode, marks=() if mode in KV_CACHE_MODES else missing)


@pytest.mark.parametrize("mode", [kv_cache_mode("persist"), kv_cache_mode("offload")])
def test_forced_lag_matches_the_cpu_tier_when_the_kv_cache_is_kept(cpu_runs, mode):
    """``persist`` keeps megatron-core's KV cache on the device between windows, ``offload``
    (0.17+) in host memory: requests that span a window continue on their keys and values, as on
    the CPU tier."""
    args = {**BASE, "rl-forced-lag": 1, "kv-cache-mode": mode}
    assert_same_run(cpu_runs[1], run_training(1, args, script=EMULATED))


def test_forced_lag_with_re_prefill_keeps_the_lag_contract(cpu_runs):
    """The default (``recompute``) suspends megatron-core's engine during training, freeing its
    KV cache: requests that span a window are re-prefilled under the new weights, so their later
    tokens differ from the CPU tier's."""
    args = {**BASE, "rl-forced-lag": 1, "kv-cache-mode": "recompute"}
    cuda = run_training(1, args, script=EMULATED)
    assert cuda[0]["reward_mean"] == cpu_runs[1][0]["reward_mean"]  # one window: identical
    assert [m["staleness_max"] for m in cuda] == [m["staleness_min"] for m in cuda] == [0, 1, 1]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in cuda)


@pytest.mark.parametrize(
    "nproc, flags",
    [
        pytest.param(1, {"bf16": True, "use-distributed-optimizer": True}, id="bf16-dist-opt"),
        pytest.param(2, {"pipeline-model-parallel-size": 2}, id="pp2"),
    ],
)
def test_cuda_only_layouts_train_with_exact_lag(nproc, flags):
    """bf16, the distributed optimizer and PP have no CPU-tier twin (PP stages initialize their
    layers from their own RNG stream, so PP=2 starts from other weights than PP=1)."""
    cuda = run_training(nproc, {**BASE, "rl-forced-lag": 1, **flags}, script=EMULATED)
    assert [m["staleness_max"] for m in cuda] == [0, 1, 1]
    for m in cuda:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert 0.0 <= m["reward_mean"] <= 1.0


def test_dist_checkpoint_resume_continues_the_run_exactly(tmp_path):
    args = {**BASE, "train-iters": 4, "rl-forced-lag": 1}
    whole = run_training(1, {**args, "save": tmp_path / "a", "save-interval": 2}, script=EMULATED)
    assert (tmp_path / "a" / "iter_0000002" / "metadata.json").is_file()  # torch_dist format
    load = checkpoint_of_iteration(tmp_path / "a", 2, tmp_path / "b")
    resumed = run_training(1, {**args, "load": load}, script=EMULATED)
    assert [m["step"] for m in resumed] == [2, 3]
    for a, b in zip(whole[2:], resumed):
        assert {k: b[k] for k in TOLERANCES} == {k: a[k] for k in TOLERANCES}


def test_step_options_match_the_cpu_tier():
    """--grpo-iterations with several global batches per collection (pi_old computed forward
    only before the first update), the entropy term and the IS correction: as on the CPU tier."""
    options = {
        "rl-forced-lag": 1,
        "kv-cache-mode": "persist",
        "grpo-iterations": 2,
        "grpo-entropy-term-weight": 0.01,
        "rl-inference-logprobs-is-correction": True,
        "train-iters": 4,
        "global-batch-size": 32,  # 4 iterations per collection: pi_old up front
    }
    cpu = run_training(1, {**BASE, **{k: v for k, v in options.items() if "kv" not in k}})
    cuda = run_training(1, {**BASE, **options}, script=EMULATED)
    assert_same_run(cpu, cuda)
    for a, b in zip(cpu, cuda):
        for metric in ("entropy", "is_kl", "is_abs_delta_p", "is_weight_mean", "ratio_mean"):
            assert b[metric] == pytest.approx(a[metric], rel=1e-4, abs=1e-7), (a["step"], metric)


def test_reference_kl_and_sequence_packing_match_the_cpu_tier():
    """The reference KL term (pi_ref from the CUDA tier's reference model) and sequence packing
    (the SDPA layer spec's block-diagonal mask) through megatron-core's schedule."""
    options = {"rl-forced-lag": 0, "grpo-kl-beta": 0.1, "rl-use-sequence-packing": True}
    cpu = run_training(1, {**BASE, **options})
    cuda = run_training(1, {**BASE, **options}, script=EMULATED)
    assert_same_run(cpu, cuda)
    for a, b in zip(cpu, cuda):
        assert b["ref_kl"] == pytest.approx(a["ref_kl"], rel=1e-4, abs=1e-7), a["step"]
    assert cpu[0]["ref_kl"] == 0.0 and cpu[-1]["ref_kl"] > 0  # the policy leaves the reference


def test_ref_load_and_a_teacher_read_the_cuda_tiers_checkpoint_as_the_cpu_tier_reads_its_own(
    cpu_runs, cuda_run, saved
):
    """``--ref-load`` and ``--distill-teacher`` on CUDA: the reference model's and the frozen
    teacher's weights from a ``dist_checkpointing`` checkpoint (the CPU tier reads its
    ``torch.save`` shards); both runs' KL terms and teacher logprobs agree
    (``CUDAPolicy.get_teacher_logprobs`` through megatron-core's schedule, with the top-k
    variant's top-k, whose loss reads the policy's logprobs of those ids in the schedule's loss
    function; k = 16 of the 21 ids: the ids near the k-th place hold little probability, so a
    near-tie there that the tiers' float rounding orders differently changes little). The checkpoints are those the
    synchronous runs of both tiers saved (``cpu_runs``, ``cuda_run``)."""
    assert (saved / "cuda" / "iter_0000003" / "metadata.json").is_file()  # torch_dist format
    options = {**BASE, "rl-forced-lag": 0, "grpo-kl-beta": 0.1, "distill-topk-logits-k": 16}
    cpu = run_training(1, {**options, "ref-load": saved / "cpu", "distill-teacher": saved / "cpu"})
    cuda = run_training(
        1,
        {**options, "ref-load": saved / "cuda", "distill-teacher": saved / "cuda"},
        script=EMULATED,
    )
    assert_same_run(cpu, cuda)
    for a, b in zip(cpu, cuda):
        for metric in (
            "ref_kl",
            "distill/reverse_kl",
            "distill/teacher_logprob",
            "distill/topk_kl",
            "distill/teacher_topk_mass",
        ):
            assert b[metric] == pytest.approx(a[metric], rel=1e-4, abs=1e-7), (a["step"], metric)
        assert b["distill/argmax_mismatch"] == a["distill/argmax_mismatch"], a["step"]
    assert cpu[0]["ref_kl"] > 0  # the reference is the trained checkpoint, not the initial weights
    assert cpu[0]["distill/reverse_kl"] != 0 and cpu[0]["distill/topk_kl"] > 0  # and the teacher


MOE_ENV = """\
- agent_type: digits
  env_id: copy
  agent_args: {task: copy}
  reward_funcs: [{function: regex, args: {pattern: "[a-m]"}}]
"""
"""The digit task rewarded by a letter in the completion: the tiny random MoE model earns
rewards that differ within groups, so the updates have gradients (it never copies digits)."""


@pytest.fixture(scope="module")
def moe_args(tmp_path_factory):
    """A 3-step run of the tiny Qwen3-MoE checkpoint (4 experts, top 2, 2 MoE layers)."""
    from megatron.rl.models.hf.tiny import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("moe")
    (tmp / "env.yaml").write_text(MOE_ENV)
    return {
        **BASE,
        "hf-checkpoint": make_tiny_checkpoint("qwen3_moe", tmp / "qwen3_moe", seed=5),
        "env-config": tmp / "env.yaml",
        "rl-forced-lag": 0,
        "seq-length": 64,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 2,
        "micro-batch-size": 2,
    }


@pytest.mark.parametrize(
    "replay", [pytest.param(False, id="own-routing"), pytest.param(True, id="routing-replay")]
)
def test_moe_run_matches_the_cpu_tier(moe_args, replay):
    """Rollouts of megatron-core's dynamic engine through the MoE layers, and the updates through
    megatron-core's DDP and optimizer (router and experts), as on the CPU tier; with routing
    replay the dynamic engine's recorded routes reach megatron-core's schedule."""
    args = {**moe_args, **({"use-rollout-routing-replay": True} if replay else {})}
    cpu = run_training(1, args)
    cuda = run_training(1, args, script=EMULATED)
    assert_same_run(cpu, cuda)
    assert all(m["moe_load_imbalance"] == c["moe_load_imbalance"] for m, c in zip(cpu, cuda))
    if replay:  # lag 0, one update per collection: the engine's routing is pi_old's
        assert [m["moe_routing_mismatch"] for m in cuda] == [0.0] * len(cuda)
        assert [m["moe_routing_mismatch"] for m in cpu] == [0.0] * len(cpu)
    assert any(m["grad_norm"] > 0 for m in cuda) and any(m["reward_mean"] > 0 for m in cuda)


def test_moe_aux_loss_trains_as_on_the_cpu_tier(moe_args):
    """With the load-balancing loss, the same aux loss and the same updates: both tiers weight
    each micro-batch's aux loss 1 / (micro-batches x DP) (``megatron/trainer/train/moe.py``)."""
    args = {**moe_args, "moe-aux-loss-coeff": 0.01}
    cpu, cuda = run_training(1, args), run_training(1, args, script=EMULATED)
    assert_same_run(cpu, cuda)
    for a, b in zip(cpu, cuda):
        assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], rel=1e-6), a["step"]
        assert b["moe_aux_loss"] > 0 and b["grad_norm"] > 0


def policy_results(nproc: int, flags: list[str], cases: list[list[str]]) -> list[list[dict]]:
    """Per ``--case`` of ``grpo_testing/emulated_cuda_policy.py`` (one launch for all): each
    rank's ``{tier: results}``."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--standalone",  # the launcher binds a port of the kernel's choice: no race for it
            POLICY,
            "--out",
            out,
            *flags,
            *(arg for case in cases for arg in ["--case", *case]),
        ]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
        return [[rank[i] for rank in ranks] for i in range(len(cases))]


POLICY_CASES = {
    "one-process": (1, [], []),
    "packed": (1, [], ["packing=24"]),
    "tp2-packed": (2, ["--tp", "2"], ["packing=24"]),
    "dp2": (2, [], []),
    "gspo-seq-mean-token-mean-sequence-mis": (1, [], ["variant=gspo"]),
    "gspo-seq-mean-token-mean-sequence-mis-dp2": (2, [], ["variant=gspo"]),
    "cispo-opsm-dp2": (2, [], ["variant=cispo"]),
}
"""Case -> (processes, layout flags, ``--case`` fields) of ``emulated_cuda_policy.py``."""


@pytest.fixture(scope="module")
def policy_case():
    """Case -> each rank's results; the cases of one layout (processes and flags) run in one
    launch, the first time one of them is asked for."""
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            nproc, flags, _ = POLICY_CASES[name]
            names = [n for n, (p, f, _) in POLICY_CASES.items() if (p, f) == (nproc, flags)]
            results = policy_results(nproc, flags, [POLICY_CASES[n][2] for n in names])
            cache.update(zip(names, results))
        return cache[name]

    return get


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_every_policy_method_matches_the_cpu_tier(policy_case, case):
    """``get_logprobs``, ``get_reference_policy_logprobs``, ``get_topk_logits`` and ``train``
    (eval mode, a supervised NLL loss, GRPO with the KL and entropy terms) on both tiers; the
    ``variant=`` cases run the GRPO updates with policy-loss variants: GSPO with
    seq-mean-token-mean (each micro-batch hands megatron-core its sequence count) and
    sequence-level masked IS, and CISPO with off-policy sequence masking."""
    for rank in policy_case(case):
        cpu, cuda = rank["cpu"], rank["cuda"]
        mask = cpu["valid"]
        for key in ("logprobs", "ref_logprobs", "topk_values"):
            torch.testing.assert_close(cuda[key][mask], cpu[key][mask], atol=1e-5, rtol=1e-5)
        assert torch.equal(cuda["topk_indices"][mask], cpu["topk_indices"][mask])
        assert cuda["nll"] == pytest.approx(cpu["nll"], rel=1e-6)
        assert cuda["grpo_loss"] == pytest.approx(cpu["grpo_loss"], rel=1e-5, abs=1e-7)
        assert cuda["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-5)
        assert cuda["lr"] == cpu["lr"]
        for a, b in zip(cpu["grpo_metrics"], cuda["grpo_metrics"]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
        assert cpu["grpo_metrics"][1]["ref_kl"] > 0  # the NLL updates moved the policy
        variant = next((f[8:] for f in POLICY_CASES[case][2] if f.startswith("variant=")), None)
        metrics = cuda["grpo_metrics"][1]
        if variant == "gspo":
            assert metrics["gspo_ratio_mean"] != 1.0 and 0 < metrics["is_masked_fraction"] < 1
            assert 0 < metrics["gspo_clipped_sequence_fraction"] < 1
        if variant == "cispo":
            assert 0 < metrics["opsm_masked_sequence_fraction"] < 1
            assert 0 < metrics["clip_fraction"] < 1 and metrics["cispo_weight_mean"] != 1.0


def test_policy_methods_agree_with_each_other_under_pipeline_parallelism():
    """PP=2 (no CPU twin): every stage returns the last stage's results, and the forward-only
    path and ``train``'s forward give the same numbers (a GRPO update against pi_old from
    ``get_logprobs`` has ratio exactly 1; the NLL of ``get_logprobs`` is ``train``'s)."""
    (results,) = policy_results(2, ["--pp", "2"], [["packing=24"]])
    first, last = (rank["cuda"] for rank in results)
    for key in ("logprobs", "ref_logprobs", "topk_values", "topk_indices"):
        assert torch.equal(first[key], last[key]), key
    assert first["nll"] == last["nll"] and first["grad_norm"] == last["grad_norm"]
    assert last["upfront_ratio_mean"] == 1.0
    assert last["nll_of_logprobs"] == pytest.approx(last["nll"][0], rel=1e-6)
    mask = last["valid"]
    assert torch.all(last["logprobs"][mask] < 0) and int(last["topk_indices"].max()) < 21


def test_non_collocated_generation_on_megatron_cores_engine_matches_the_cpu_tier():
    """--refit-mode non-collocated on the CUDA tier: the inference rank runs megatron-core's
    DynamicInferenceEngine on a world of its own and gets each step's weights over the bridge
    (staged through host memory), checked by its checksums; at L=1 (the least non-collocated
    lag: each batch generated in one window) it samples what the CPU tier's non-collocated run
    samples."""
    args = {
        **BASE,
        "rl-forced-lag": 1,
        "refit-mode": "non-collocated",
        "rl-verify-model-weights-swap": True,
    }
    assert_same_run(run_training(2, args), run_training(2, args, script=EMULATED))
