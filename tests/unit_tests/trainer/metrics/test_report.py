"""The run's header, step timing, closing summary and curves; megatron-core's kernel warnings
condensed."""

from __future__ import annotations

import warnings

import pytest

from megatron.rl.agent.env_config import build_agents
from megatron.rl.tokenizer import CharTokenizer
from megatron.trainer.config import model_build
from megatron.trainer.flags.parse import check
from megatron.trainer.generation.rollouts import endpoint_line
from megatron.trainer.metrics import report
from megatron.trainer.metrics.log_line import format_duration, format_log_line
from megatron.trainer.model.provider import architecture
from megatron.trainer.runtime.kernels import kernel_warnings


def test_kernel_warnings_are_collected_and_other_warnings_pass():
    with pytest.warns(UserWarning, match="something else"):
        with kernel_warnings() as missing:
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to X")
            warnings.warn("Apex is not installed. Falling back to Torch Norm")
            warnings.warn("something else")
    assert missing == {"Transformer Engine", "Apex"}


def test_megatron_core_notices_are_folded_into_one_header_line():
    import logging

    from megatron.trainer.runtime import kernels

    with kernel_warnings() as missing:
        warnings.warn("absl.logging is not installed. Using logging.getLogger(__name__) instead.")
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    assert not logger.filter(logging.makeLogRecord({"msg": "GPTModel IS DEPRECATED. GPTModel"}))
    assert logger.filter(logging.makeLogRecord({"msg": "something else"}))
    assert missing == set()
    assert {
        "absl-py not installed (Python logging instead)",
        "GPTModel deprecated upstream in favour of HybridModel",
    } <= set(kernels.notices())
    assert report.notices_line(["a", "b"]) == "megatron     a; b"


@pytest.mark.parametrize(
    "seconds, text", [(3, "3s"), (125, "2m05s"), (3723, "1h02m03s"), (0.4, "0s")]
)
def test_durations(seconds, text):
    assert format_duration(seconds) == text


def parsed(*argv: str):
    args, errors = check(list(argv))
    assert errors == []
    return args


def test_the_header_names_model_tokenizer_environments_lag_batch_layout_and_outputs(tmp_path):
    args = parsed(
        "--rl-forced-lag",
        "2",
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
        "--save",
        str(tmp_path / "ck"),
    )
    agent = build_agents(
        [
            {"agent_type": "digits", "env_id": "copy", "weight": 3},
            {"agent_type": "digits", "env_id": "add", "agent_args": {"task": "add"}, "weight": 1},
        ]
    )
    arch = architecture(model_build(args), 21)
    text = report.header(
        args, arch, 110_000, CharTokenizer(), agent, "tier: cpu", {"Apex"}, tmp_path / "m.png"
    )
    lines = text.splitlines()
    assert lines[0].startswith("model        0.11M parameters (random init): 2 x 64, 4 heads")
    assert "CharTokenizer, 21 ids" in lines[1]
    assert "copy (75%), add (25%)" in lines[2]
    assert "forced lag 2, 8 prompts x 8 samples = 64 per collection" in lines[3]
    assert "TP 1 x PP 1 x DP 1" in lines[4]
    assert str(tmp_path / "m.jsonl") in lines[5] and str(tmp_path / "ck") in lines[5]
    assert lines[6] == "kernels      Apex not installed: megatron-core's local implementations"


def test_the_header_names_the_reward_functions_of_an_environment():
    args = parsed("--rl-forced-lag", "1")
    agent = build_agents(
        [
            {
                "agent_type": "digits",
                "env_id": "copy",
                "reward_funcs": [
                    {"function": "environment"},
                    {
                        "function": "regex",
                        "name": "digits",
                        "weight": 0.1,
                        "args": {"pattern": "^[0-9]+$"},
                    },
                ],
            },
            {"agent_type": "digits", "env_id": "add", "agent_args": {"task": "add"}},
        ]
    )
    text = report.header(
        args, architecture(model_build(args), 21), 1, CharTokenizer(), agent, "cpu", set(), None
    )
    assert "environments copy (50%; reward 1 environment + 0.1 digits), add (50%)" in text


def records(lag: int, steps: int, broken_at: int | None = None) -> list[dict]:
    out = []
    for s in range(steps):
        staleness = min(s, lag) + (1 if s == broken_at else 0)
        out.append(
            {
                "step": s,
                "batch_id": s,
                "batch_staleness": staleness,
                "reward_mean": s / steps,
                "loss": 1.0 / (s + 1),
            }
        )
    return out


def test_the_summary_reports_rewards_staleness_and_paths(tmp_path):
    args = parsed("--metrics-file", str(tmp_path / "m.jsonl"))
    text = report.summary(records(2, 40), 2, 12.5, args, tmp_path / "m.png")
    assert "40 steps (0..39) in 12.5 s; reward first-10 0.113, last-10 0.863" in text
    assert "staleness    exact" in text
    assert f"curves       {tmp_path / 'm.png'}" in text and "metrics" in text
    assert "NOT exact" in report.summary(records(2, 40, broken_at=7), 2, 1.0, args, None)


def test_curves_are_a_png(tmp_path):
    path = report.write_curves(records(2, 30), tmp_path / "c" / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_the_step_line_ends_with_elapsed_and_eta():
    m = {
        "step": 3,
        "loss": 0.1,
        "reward_mean": 0.5,
        "reward_std": 0.1,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "lag": 2,
        "staleness_min": 2,
        "staleness_mean": 2.0,
        "staleness_max": 2,
        "token_staleness_min": 0,
        "token_staleness_mean": 1.0,
        "token_staleness_max": 2,
        "in_flight_batches": 3,
        "queue_depth": 0,
        "generated_tokens_per_s": 1.0,
        "trained_tokens_per_s": 1.0,
        "step_seconds": 0.05,
        "placeholder_rollouts": 0,
    }
    line = format_log_line(m, 10, " | elapsed 4s | eta 7s")
    assert line.startswith("step     3/10") and "step 50 ms | elapsed 4s | eta 7s" in line


@pytest.mark.parametrize(
    "source, tail",
    [
        pytest.param("none", "(OpenAI-style; no key)", id="no-key"),
        pytest.param(
            "--rl-api-key-file /k",
            "(OpenAI-style; bearer key from --rl-api-key-file /k)",
            id="file",
        ),
    ],
)
def test_the_endpoint_line_gives_the_base_url_and_where_the_key_came_from(source, tail):
    line = endpoint_line("http://127.0.0.1:41234", source)
    assert line == f"endpoint     http://127.0.0.1:41234/v1 {tail}"
