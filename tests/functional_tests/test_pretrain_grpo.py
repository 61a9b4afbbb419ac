"""End-to-end runs of ``pretrain_grpo.py`` under torchrun: golden values and the acceptance checks.

Runs are cached per module, so each case trains once; they use OMP_NUM_THREADS=1 so that
single-process and two-process runs do the same arithmetic.
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import time

import pytest
from golden_values import (
    CASES,
    ROOT,
    TOLERANCES,
    case_names,
    compare,
    env_server,
    format_table,
    load_case,
    missing_modules,
    read_metrics,
    remote_env_config,
    run_training,
    subprocess_env,
)

DETERMINISTIC = list(TOLERANCES)  # every guarded metric; timings are not


def golden_case(name: str):
    """A case as a parameter; one that ``requires:`` modules is skipped where they are missing
    (and marked ``transferqueue`` when it needs that extra)."""
    requires, missing = load_case(name).get("requires", []), missing_modules(name)
    if not requires:
        return name
    marks = [pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")]
    marks += [pytest.mark.transferqueue] if "transfer_queue" in requires else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("case", [golden_case(name) for name in case_names()])
def test_metrics_match_golden_values(runs, case):
    problems = compare(case, runs(case))
    assert not problems, "\n" + format_table(problems)


def test_a_perturbed_golden_value_fails_with_a_table_naming_step_and_metric(runs):
    golden = json.loads((CASES / "lag2" / "golden_values.json").read_text())
    perturbed = copy.deepcopy(golden)
    perturbed["loss"][5] *= 1.01
    perturbed["staleness_max"][3] += 1
    problems = compare("lag2", runs("lag2"), perturbed)
    assert [(p[0], p[1]) for p in problems] == [(5, "loss"), (3, "staleness_max")]
    table = format_table(problems).splitlines()
    assert table[0].split() == ["step", "metric", "golden", "actual", "difference"]
    assert table[2].split()[:2] == ["5", "loss"]


def test_lag_2_submission_staleness_is_exactly_2_after_warm_up(runs):
    for m in runs("lag2"):
        expected = min(m["step"], 2)
        assert (m["staleness_min"], m["staleness_max"]) == (expected, expected), m["step"]
        assert m["lag"] == 2 and m["in_flight_batches"] == 3
        assert 0 <= m["token_staleness_min"] <= m["token_staleness_max"] <= expected


def test_lag_0_is_on_policy_at_every_step(runs):
    for m in runs("lag0"):
        assert m["staleness_min"] == m["staleness_max"] == 0
        assert m["token_staleness_max"] == 0 and m["in_flight_batches"] == 1
        assert m["queue_depth"] == 0


@pytest.mark.parametrize(
    "single_case, case",
    [
        pytest.param("lag2", "lag2_tp2", id="lag2_tp2"),
        pytest.param("lag2", "lag2_dp2", id="lag2_dp2"),
        pytest.param("moe_lag2", "moe_lag2_ep2", id="moe_lag2_ep2"),
        pytest.param("lora_lag2", "lora_lag2_tp2", id="lora_lag2_tp2"),
        pytest.param("lag2", "refit_tp1_resume", id="refit_tp2_to_tp1"),
        pytest.param("moe_lag2", "moe_refit_ep2_to_tp1", id="moe_refit_ep2_to_tp1"),
    ],
)
def test_two_process_runs_match_the_single_process_run(runs, single_case, case):
    """Rewards are identical (same tokens); losses agree to float32 rounding.

    The GRPO loss sums terms whose group-normalized advantages nearly cancel, so a step's loss
    can be ~1e-3 while TP's different reduction order moves it by ~1e-7: relative 1e-4, with an
    absolute floor of 1e-6 for losses that close to zero. The MoE case at DP=2 x EP=2 holds half
    of each layer's experts per rank; the LoRA case at TP=2 splits each adapter as its layer.
    """
    single, parallel = runs(single_case), runs(case)  # (refit_tp1_resume: generated at TP=1)
    for a, b in zip(single[:5], parallel[:5]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_collocated_refit_at_the_training_layout_is_the_plain_run_bitwise(runs):
    """An inference copy at the training layout (each rank copies its own shards after every
    step) generates what the trained model itself generates: every metric equal, not close."""
    args = {**load_case("lag2_tp2")["args"], "rl-inference-tensor-model-parallel-size": 2}
    refit = run_training(2, args)
    plain = runs("lag2_tp2")
    assert [{k: m[k] for k in DETERMINISTIC} for m in refit] == [
        {k: m[k] for k in DETERMINISTIC} for m in plain
    ]
    assert all(m["refit/bytes_received"] == 0 < m["refit/bytes_written"] for m in refit)


def test_an_moe_copy_gathers_the_other_ranks_experts_at_every_refit(runs):
    """Trained at EP=2, each rank's TP=1 copy holds all 4 experts: every refit receives the 2
    experts of each layer the rank does not train, and writes every weight of the model."""
    for m in runs("moe_refit_ep2_to_tp1"):
        assert 0 < m["refit/bytes_received"] < m["refit/bytes_written"], m["step"]


@pytest.mark.parametrize(
    "case, nproc, layout",
    [
        pytest.param("variants_lag2", 2, {"tensor-model-parallel-size": 2}, id="gspo-mis-tp2"),
        pytest.param("variants_lag1_dp2", 1, {}, id="cispo-rloo-opsm-dp1"),
    ],
)
def test_the_loss_variants_agree_across_parallel_layouts(runs, case, nproc, layout):
    """The two golden loss-variant combinations (GSPO + seq-mean-token-mean + overlong shaping +
    sequence-level MIS at L=2; CISPO + RLOO + OPSM at L=1 under DP=2) in another layout: the same
    tokens and rewards, and losses to float32 rounding, for the first steps, as the default loss;
    the variants' own metrics move (they are not a no-op)."""
    golden = runs(case)
    other = run_training(nproc, {**load_case(case)["args"], **layout, "exit-interval": 6})
    for a, b in zip(golden[:5], other[:5]):
        assert b["reward_mean"] == a["reward_mean"] and b["staleness_max"] == a["staleness_max"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6), a["step"]
    moved = ("gspo_ratio_mean", "overlong_penalized_fraction", "is_masked_sequence_fraction")
    if case == "variants_lag1_dp2":
        moved = ("cispo_weight_mean", "opsm_masked_sequence_fraction")
    for key in moved:
        assert any(m[key] not in (0.0, 1.0) for m in golden), key


def test_seq_logprob_error_mask_under_dp2_matches_one_process():
    """With the keyed data plane each DP rank holds its shard: the per-row errors are added over
    data parallelism, and both ranks mask the same rows, as one process does."""
    args = {**load_case("lag2")["args"], "train-iters": 4, "rl-log-seq-logprob-error": True}
    measured = run_training(1, args)[2]  # step 2 trains on tokens of an older policy
    threshold = (measured["seq_mult_prob_error_mean"] + measured["seq_mult_prob_error_max"]) / 2
    args = {**args, "rl-seq-logprob-error-threshold": threshold}
    single, parallel = run_training(1, args), run_training(2, args)
    assert single[2]["seq_logprob_error_masked_sequences"] >= 1
    for a, b in zip(single, parallel):
        for key in ("seq_mult_prob_error_mean", "seq_mult_prob_error_max", "loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        for key in ("seq_logprob_error_masked_sequences", "reward_mean"):
            assert b[key] == a[key], (a["step"], key)


@pytest.mark.slow
def test_tp2_and_dp2_learning_curves_agree_with_tp1_statistically():
    """Over 200 steps TP=2 and DP=2 reproduce TP=1's rewards exactly only until float rounding of
    their reduction order first flips a sampled token (measured: first difference at steps 30-98,
    median 58, over 17 seeds), then drift like runs with another seed.

    Measured over 17 seeds (1234 and 1-16; 200 steps, forced lag 2, OMP_NUM_THREADS=1, 2 cores):
    the mean reward of the last 100 steps of TP=2 or DP=2 differed from TP=1's by at most 0.183
    (34 pairs, sd 0.051; TP=2 - TP=1 mean -0.001, DP=2 - TP=1 mean +0.028, paired t 1.9, not
    significant at 5%), while TP=1's own varied across seeds with sd 0.091 (0.13-0.54). Hence the
    tolerance 0.2 (3.9 sd of the differences); and each layout must have learned: last-100 mean
    at least 3x its first-10 mean (measured: >= 4.4x). Seed 1234: TP=1 0.227, TP=2 0.206, DP=2
    0.281.
    """
    args = {"rl-forced-lag": 2, "train-iters": 200, "seed": 1234}
    curves = {
        "tp1": run_training(1, args, timeout=900),
        "tp2": run_training(2, {**args, "tensor-model-parallel-size": 2}, timeout=900),
        "dp2": run_training(2, args, timeout=900),
    }
    rewards = {k: [m["reward_mean"] for m in v] for k, v in curves.items()}
    last = {k: statistics.fmean(v[-100:]) for k, v in rewards.items()}
    first = {k: statistics.fmean(v[:10]) for k, v in rewards.items()}
    print("last-100 mean reward:", {k: round(v, 3) for k, v in last.items()})
    for layout in ("tp2", "dp2"):
        assert rewards[layout][:10] == rewards["tp1"][:10], layout  # exact before any drift
        assert abs(last[layout] - last["tp1"]) <= 0.2, (layout, last)
    for layout, value in last.items():
        assert value >= 3 * first[layout], (layout, first, last)


def test_same_command_twice_gives_bitwise_identical_metrics(runs):
    first = runs("lag2")
    case = load_case("lag2")
    second = run_training(case["nproc_per_node"], case["args"])
    for metric in DETERMINISTIC:
        assert [m[metric] for m in second] == [m[metric] for m in first], metric


def test_remote_env_run_equals_the_in_process_run_bitwise(runs):
    """The deterministic engine schedule makes HTTP timing irrelevant: same tokens, same steps."""
    remote, local = runs("lag2_remote_env"), runs("lag2")
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in remote)
    for metric in DETERMINISTIC:
        assert [m[metric] for m in remote] == [m[metric] for m in local], metric


@pytest.mark.transferqueue
def test_transferqueue_data_plane_run_equals_the_in_process_run_bitwise(runs):
    """Where the samples live does not change a number: same rows on the same ranks."""
    missing = missing_modules("lag2_dp2_transferqueue")
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    remote, local = runs("lag2_dp2_transferqueue"), runs("lag2_dp2")
    for metric in DETERMINISTIC:
        assert [m[metric] for m in remote] == [m[metric] for m in local], metric


def test_a_yaml_run_file_with_overrides_reproduces_the_cli_run_bitwise(runs, tmp_path):
    """lag2 from a run file (``--config``) whose seed the command line overrides: the golden run,
    bitwise; and the resolved run file it writes next to its metrics reruns it again."""
    case = load_case("lag2")
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "".join(f"{k.replace('-', '_')}: {v}\n" for k, v in case["args"].items() if k != "seed")
        + "seed: 7\n"
    )
    metrics = tmp_path / "written.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "pretrain_grpo.py",
            "--config",
            str(run_file),
            "--seed",
            "1234",
            "--metrics-file",
            str(metrics),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from_file, reference = read_metrics(metrics), runs("lag2")
    for metric in DETERMINISTIC:
        assert [m[metric] for m in from_file] == [m[metric] for m in reference], metric
    resolved = metrics.with_suffix(".config.yaml")
    assert "rl-forced-lag: 2" in resolved.read_text() and "seed: 1234" in resolved.read_text()
    again = run_training(1, {"config": resolved})
    for metric in DETERMINISTIC:
        assert [m[metric] for m in again] == [m[metric] for m in reference], metric


def test_resume_after_kill_9_continues_the_uninterrupted_run_exactly(runs, tmp_path):
    """lag2_resume: saved at 10, every process killed after step 12, resumed from step 10.

    Steps 10-19 of the resumed run equal the steps of the run that never saved bitwise,
    submission and token staleness included: the save kept the two batches in flight as they
    were (``test_exact_resume.py`` stops runs at any step)."""
    case = load_case("lag2_resume")
    uninterrupted = run_training(case["nproc_per_node"], case["args"])
    resumed = runs("lag2_resume")
    assert [m["step"] for m in resumed] == list(range(20))
    for metric in [*DETERMINISTIC, "in_flight_batches", "queue_depth"]:
        assert [m[metric] for m in resumed] == [m[metric] for m in uninterrupted], metric
    assert all(m["staleness_min"] == m["staleness_max"] == 2 for m in resumed[2:])


def test_reward_wait_budget_keeps_the_run_independent_of_timing(runs, tmp_path):
    """--rl-reward-wait-steps: with the environment behind the env server (HTTP timing), the run
    equals the in-process one bitwise, submission staleness stays exact, and the budget does
    change the schedule: later batches generate tokens earlier (older policy versions)."""
    case = load_case("lag2_remote_env")
    nproc, args = case["nproc_per_node"], {**case["args"], "rl-reward-wait-steps": 8}
    local = run_training(nproc, args)
    with env_server(tmp_path, case["env_server"]) as (url, _):
        env_config = remote_env_config(tmp_path, url, ["copy"])
        remote = run_training(nproc, {**args, "env-config": env_config})
    for metric in DETERMINISTIC:
        assert [m[metric] for m in remote] == [m[metric] for m in local], metric
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in local)
    without = runs("lag2")
    assert sum(m["token_staleness_mean"] for m in local) > sum(
        m["token_staleness_mean"] for m in without
    )


def test_throughput_schedule_keeps_submission_staleness_exact():
    """--no-rl-deterministic-schedule lets later batches generate during reward waits: which
    window generates a token depends on timing, the batch a step trains on does not."""
    case = load_case("lag2")
    args = {**case["args"], "train-iters": 8, "no-rl-deterministic-schedule": True}
    metrics = run_training(case["nproc_per_node"], args)
    assert [(m["staleness_min"], m["staleness_max"]) for m in metrics] == [
        (min(s, 2), min(s, 2)) for s in range(8)
    ]
    assert all(0 <= m["token_staleness_max"] <= min(m["step"], 2) for m in metrics)


def test_bad_env_config_exits_naming_file_entry_and_field(tmp_path):
    config = tmp_path / "envs.yaml"
    config.write_text("- agent_type: digits\n  agent_args: {task: copy, max_digitz: 3}\n")
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", f"--env-config={config}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert str(config) in proc.stderr and "entry 0" in proc.stderr
    assert "agent_args.max_digitz" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param({}, id="default"),
        pytest.param({"rl-inference-logprobs-is-correction": True}, id="is-correction"),
    ],
)
def test_default_main_job_learns_within_ten_minutes(flags):
    """The README's main command: reward rises from ~0.03 to >= 0.5 with forced lag 2; also with
    the IS correction on, whose mismatch metrics are then logged (non-zero once the policy moved).
    """
    start = time.monotonic()
    metrics = run_training(1, {"rl-forced-lag": 2, **flags}, timeout=600)
    elapsed = time.monotonic() - start
    rewards = [m["reward_mean"] for m in metrics]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    print(
        f"default run {flags}: {len(metrics)} steps in {elapsed:.0f} s, reward first-10 "
        f"{first:.3f} last-10 {last:.3f}"
    )
    assert elapsed < 600
    assert last >= 0.5 and last >= 2 * first
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in metrics)
    if flags:
        assert all(m["is_kl"] > 0 and m["is_abs_delta_p"] > 0 for m in metrics[2:])


SHAPING_METRICS = (
    "advantages_mean",
    "advantages_abs_mean",
    "advantages_min",
    "advantages_max",
    "overlong_penalty_mean",
    "overlong_penalized_fraction",
    "truncated_fraction",
    "truncated_masked_rollouts",
)


def test_rloo_batch_scale_and_overlong_shaping_keep_the_lag_contract_bitwise():
    """RLOO, the batch scale, DAPO's overlong penalty (a buffer of 2 tokens of each digit
    problem's own budget) and the mask of truncated completions at --rl-forced-lag 1: submission
    staleness is exactly min(step, 1), the same command twice gives the same metrics bit for bit
    (the shaping's included), and the options change the first loss but not the first batch (all
    generated before any update; the logged reward is the environment's)."""
    base = {**load_case("lag2")["args"], "rl-forced-lag": 1, "train-iters": 6}
    args = {
        **base,
        "adv-estimator": "rloo",
        "scale-rewards": "batch",
        "overlong-buffer-len": 2,
        "mask-truncated-completions": True,
    }
    first, second = run_training(1, args), run_training(1, args)
    for metric in [*DETERMINISTIC, *SHAPING_METRICS]:
        assert [m[metric] for m in second] == [m[metric] for m in first], metric
    for m in first:
        expected = min(m["step"], 1)
        assert (m["staleness_min"], m["staleness_max"]) == (expected, expected), m["step"]
        assert m["lag"] == 1 and m["in_flight_batches"] == 2
        assert 0 <= m["token_staleness_min"] <= m["token_staleness_max"] <= expected
        assert m["overlong_penalty_mean"] <= 0 and 0 <= m["truncated_fraction"] <= 1
    assert any(m["truncated_masked_rollouts"] > 0 for m in first)
    assert any(m["overlong_penalty_mean"] < 0 for m in first)
    plain = run_training(1, base)
    assert first[0]["reward_mean"] == plain[0]["reward_mean"]
    assert first[0]["completion_tokens_mean"] == plain[0]["completion_tokens_mean"]
    assert first[0]["loss"] != plain[0]["loss"]
    assert "overlong_penalty_mean" not in plain[0] and "advantages_mean" not in plain[0]
