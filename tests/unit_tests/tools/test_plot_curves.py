"""tools/plot_curves.py: golden values and metrics files to one PNG; bad input named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("plot_curves", ROOT / "tools" / "plot_curves.py")
plot_curves = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_curves)


def write_metrics(path: Path, losses: list[float]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"step": s, "loss": v, "reward_mean": 0.1 * s, "staleness_mean": min(s, 2)})
            + "\n"
            for s, v in reversed(list(enumerate(losses)))  # order on disk does not matter
        )
    )
    return path


def test_metrics_file_is_read_in_step_order(tmp_path):
    curves = plot_curves.load_curves(write_metrics(tmp_path / "m.jsonl", [0.5, 0.25, 0.125]))
    assert curves["step"] == [0, 1, 2] and curves["loss"] == [0.5, 0.25, 0.125]
    assert curves["staleness_mean"] == [0, 1, 2]


def test_golden_vs_actual_png_is_written(tmp_path):
    golden = ROOT / "tests/functional_tests/test_cases/lag2/golden_values.json"
    actual = write_metrics(tmp_path / "m.jsonl", [0.1] * 12)
    out = tmp_path / "plots" / "lag2.png"
    assert plot_curves.main([f"golden={golden}", f"actual={actual}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_malformed_metrics_line_is_named_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \n')
    with pytest.raises(SystemExit):
        plot_curves.main([str(bad), "-o", str(tmp_path / "x.png")])
    assert f"{bad}, line 2: not JSON" in capsys.readouterr().err
