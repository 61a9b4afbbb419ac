"""tools/refit_bandwidth.py: the weight set it moves is the real model's, parameter for parameter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location(
    "refit_bandwidth", ROOT / "tools" / "refit_bandwidth.py"
)
refit_bandwidth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refit_bandwidth)


@pytest.mark.parametrize(
    "shape, parameters",
    [  # the published parameter counts (tied embeddings)
        pytest.param("llama-3.2-1b", 1_235_814_400, id="llama-3.2-1b"),
        pytest.param("qwen2.5-1.5b", 1_543_714_304, id="qwen2.5-1.5b-qkv-bias"),
    ],
)
def test_the_weights_of_a_shape_count_its_parameters(shape, parameters):
    shapes = refit_bandwidth.weight_shapes(refit_bandwidth.shapes_of(shape))
    assert sum(torch.Size(s).numel() for s in shapes) == parameters


def test_fewer_than_one_repeat_is_refused(capsys):
    with pytest.raises(SystemExit):
        refit_bandwidth.main(["--shape", "tiny", "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
