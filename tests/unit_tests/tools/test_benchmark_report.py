"""tools/benchmarks report, targets and plot: the committed RESULTS.md is exactly what the report
code renders from the committed results.json, and each target line says met / not met by its
threshold."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tools.benchmarks import report, targets

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    return json.loads((RESULTS / "results.json").read_text())


@pytest.fixture
def res(committed) -> dict[str, Any]:
    """A copy of the committed results that a test may change."""
    return copy.deepcopy(committed)


def test_committed_results_md_is_rendered_from_results_json(committed):
    """A hand edit of RESULTS.md, or a report change without ``run_all.py --render-only``,
    fails here."""
    assert report.report(committed) == (RESULTS / "RESULTS.md").read_text()


def test_committed_lora_md_is_rendered_from_lora_json():
    """``lora.md`` is what ``tools/benchmarks/lora.py``'s ``markdown`` writes from ``lora.json``."""
    from tools.benchmarks import lora

    res = json.loads((RESULTS / "lora.json").read_text())
    assert lora.markdown(res) + "\n" == (RESULTS / "lora.md").read_text()


def line(lines: list[str], start: str) -> str:
    (found,) = [x for x in lines if x.startswith(start)]
    return found


def verdict(text: str) -> str:
    assert ("**met**" in text) != ("**not met**" in text), text
    return "met" if "**met**" in text else "not met"


def by_name(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (row,) = [r for r in rows if r["name"] == name]
    return row


# a ratio a hair above, exactly at, and a hair below its target; ">= target" is met at the target
SIDES = [(1.01, "met"), (1.0, "met"), (0.99, "not met")]


@pytest.mark.parametrize("factor, expected", SIDES)
@pytest.mark.parametrize(
    "row, schedule", [("L=2", "deterministic"), ("L=2, throughput", "throughput")]
)
def test_l2_over_l0_steps_per_s_target(res, row, schedule, factor, expected):
    r = by_name(res["lag_sweep"]["results"], row)
    r["steps_per_s_ratio"] = targets.LAG_TARGET * factor
    text = line(targets.targets(res), f"- L=2 steps/s >= {targets.LAG_TARGET}x L=0, {schedule} ")
    assert verdict(text) == expected
    assert text in report.report(res)


@pytest.mark.parametrize("factor, expected", SIDES)
@pytest.mark.parametrize(
    "row, schedule, target",
    [
        ("L=2", "deterministic (reward-wait budget)", targets.DETERMINISTIC_LAG_TARGET),
        ("L=2, throughput", "throughput", targets.THROUGHPUT_LAG_TARGET),
    ],
)
def test_l2_over_l0_target_of_each_lag_schedule(res, row, schedule, target, factor, expected):
    by_name(res["lag_sweep"]["results"], row)["steps_per_s_ratio"] = target * factor
    text = line(
        targets.lag_targets(res["lag_sweep"]), f"- L=2 steps/s >= {target}x L=0, {schedule}"
    )
    assert verdict(text) == expected
    assert text in report.report(res)


@pytest.mark.parametrize(
    "overall, rounds, expected",
    [(1.2, [1.1, 1.3], "met"), (0.9, [0.8, 1.0], "not met"), (1.2, [0.99, 1.4], "not met")],
)
def test_faster_than_trl_needs_every_round_faster(res, overall, rounds, expected):
    r = by_name(res["trl"]["results"], "ours L=2")
    r["speedup_vs_trl"], r["speedup_vs_trl_per_round"] = overall, rounds
    assert verdict(line(targets.targets(res), "- ours faster than TRL at L=2")) == expected


@pytest.mark.parametrize("factor, expected", SIDES)
@pytest.mark.parametrize(
    "name, target, what",
    [
        ("HF generate, batch 64", targets.HF_TARGET, "HF `generate`"),
        ("engine, one at a time", targets.SERIAL_TARGET, "the engine one request"),
    ],
)
def test_engine_targets_judged_in_cpu_time(res, name, target, what, factor, expected):
    shape = res["hf_shapes"]["shapes"][0]
    r = by_name(shape["results"], name)
    r["cpu_engine_batch_over_this"] = target * factor
    r["engine_batch_over_this"] = target * (2 - factor)  # the wall clock ratio does not judge
    label = f"- Llama {shape['shape'].upper()} ("
    lines = [x for x in targets.hf_targets(res["hf_shapes"]) if x.startswith(label) and what in x]
    assert len(lines) == 1 and verdict(lines[0]) == expected


@pytest.mark.parametrize("factor, expected", SIDES)
@pytest.mark.parametrize(
    "key, target, what",
    [
        ("train_fraction", targets.TRAIN_MATMUL_TARGET, "a training step"),
        ("decode_fraction", targets.DECODE_MATMUL_TARGET, "engine decode"),
    ],
)
def test_matmul_targets(res, key, target, what, factor, expected):
    (shape,) = [s for s in res["hf_shapes"]["shapes"] if s["shape"] == "25m"]
    shape["matmul"][key] = target * factor
    lines = [x for x in targets.hf_targets(res["hf_shapes"]) if "Llama 25M" in x and what in x]
    assert len(lines) == 1 and verdict(lines[0]) == expected


@pytest.mark.parametrize("factor, expected", SIDES)
@pytest.mark.parametrize(
    "name, target", [("ours L=0", targets.TRL_L0_TARGET), ("ours L=2", targets.TRL_L2_TARGET)]
)
def test_whole_step_targets_against_trl(res, name, target, factor, expected):
    r = by_name(res["trl_hf"]["1m"]["results"], name)
    r["cpu_speedup_vs_trl"] = target * factor
    r["speedup_vs_trl"] = target * (2 - factor)  # the wall clock ratio does not judge
    start = f"- Llama 1M: {name} whole GRPO step >= {target}x TRL: "
    assert verdict(line(targets.trl_hf_targets(res["trl_hf"]), start)) == expected


def test_training_ceiling_is_said_beside_the_whole_step_ratio(res):
    from tools.benchmarks import trl_side_by_side

    shape = res["trl_hf"]["1m"]
    r = by_name(shape["results"], "ours L=2")
    r["train_seconds_per_step"], r["training_ceiling_vs_trl"] = 0.125, 1.9
    text = line(targets.trl_hf_targets(res["trl_hf"]), "- Llama 1M: ours L=2 whole GRPO step")
    assert text.endswith("TRL ÷ our training step alone (0.125 s) = 1.90x.")
    rows = trl_side_by_side.markdown(shape).splitlines()
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|")  # one cell per column
    ours = next(x for x in rows if x.startswith("| ours L=2 |"))
    assert ours.endswith("| 0.125 (1.90x) |")
    assert next(x for x in rows if x.startswith("| trl |")).endswith("| n/a |")


@pytest.mark.parametrize("ours_mib, expected", [(500.0, "met"), (591.0, "met"), (592.0, "not met")])
def test_peak_rss_target(res, ours_mib, expected):
    rows = res["trl_hf"]["1m"]["results"]
    by_name(rows, "trl")["peak_rss_mib"] = 591.0
    by_name(rows, "ours L=0")["peak_rss_mib"] = 400.0
    by_name(rows, "ours L=2")["peak_rss_mib"] = ours_mib  # the larger of ours judges
    text = line(targets.trl_hf_targets(res["trl_hf"]), "- Llama 1M: peak RSS ours <= TRL")
    assert verdict(text) == expected


def test_plot_writes_the_five_panel_png(committed, tmp_path):
    pytest.importorskip("matplotlib")
    from tools.benchmarks import plots

    out = tmp_path / "benchmarks.png"
    plots.plot(committed, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (2970, 572)  # figsize (27, 5.2) at 110 dpi


def test_report_names_a_later_hf_shapes_run_only_when_there_was_one(res):
    """A full ``run_all.py`` stamps section 4 with its own start (no note, however long the
    earlier benchmarks took); ``--only hf_shapes`` keeps the old report's start (a note)."""
    res["hf_shapes"]["started"] = "2026-01-01 00:09 UTC"  # the sub-run began later
    res["hf_shapes"]["run_started"] = res["started"]
    assert "measured by a later" not in report.report(res)
    res["hf_shapes"]["run_started"] = "2026-01-02 00:00 UTC"
    assert f"run, started {res['hf_shapes']['started']}" in report.report(res)
