"""The example model configs define MODEL_ARGS that pretrain_grpo.py parses and validates."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from megatron.trainer.flags.parse import check

ROOT = Path(__file__).resolve().parents[4]
CONFIGS = ROOT / "examples/rl/model_configs"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def model_args(name: str) -> list[str]:
    """``MODEL_ARGS`` after ``source``-ing the file in a clean bash."""
    script = f'set -eu; source "{CONFIGS / name}"; printf "%s\\0" "${{MODEL_ARGS[@]}}"'
    out = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", script],
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    return out.split("\0")[:-1]


def parse(argv: list[str], world_size: int, cuda: bool):
    return check(argv, world_size, cuda)


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.sh")) == [
        "gpt_1b_tp2.sh",
        "gpt_8b_tp8.sh",
        "tiny_cpu.sh",
    ]


def test_tiny_cpu_is_exactly_the_defaults():
    args, errors = parse(model_args("tiny_cpu.sh"), world_size=1, cuda=False)
    defaults, _ = parse([], world_size=1, cuda=False)
    assert errors == []
    assert {**args.flat(), "run_started": 0} == {**defaults.flat(), "run_started": 0}


@pytest.mark.parametrize(
    "name, world_size, layers, hidden, tp, dp",
    [
        pytest.param("gpt_1b_tp2.sh", 8, 24, 2048, 2, 4, id="1b-on-8-gpus"),
        pytest.param("gpt_1b_tp2.sh", 2, 24, 2048, 2, 1, id="1b-on-2-gpus"),
        pytest.param("gpt_8b_tp8.sh", 8, 40, 4096, 8, 1, id="8b-on-8-gpus"),
        pytest.param("gpt_8b_tp8.sh", 16, 40, 4096, 8, 2, id="8b-on-2-nodes"),
    ],
)
def test_gpu_configs_validate_on_cuda(name, world_size, layers, hidden, tp, dp):
    args, errors = parse(model_args(name), world_size=world_size, cuda=True)
    assert errors == []
    assert (args.model.num_layers, args.model.hidden_size) == (layers, hidden)
    assert (args.parallelism.tensor_model_parallel_size, args.data_parallel_size) == (tp, dp)


@pytest.mark.parametrize(
    "name, billions",
    [
        pytest.param("gpt_1b_tp2.sh", 1.21, id="1b"),
        pytest.param("gpt_8b_tp8.sh", 8.06, id="8b"),
    ],
)
def test_gpu_config_sizes_match_their_comments(name, billions):
    args, _ = parse(model_args(name), world_size=8, cuda=True)
    h, f, layers = args.model.hidden_size, args.model.ffn_hidden_size, args.model.num_layers
    # per layer: QKV + output projection 4h^2, MLP 2hf, plus biases and two layer norms
    per_layer = 4 * h * h + 2 * h * f + (4 * h + f + h) + 4 * h
    embeddings = 128 * h + args.model.max_position_embeddings * h  # padded char vocab, positions
    assert (layers * per_layer + embeddings) / 1e9 == pytest.approx(billions, abs=0.01)


def test_later_flags_override_model_args():
    args, errors = parse(model_args("tiny_cpu.sh") + ["--hidden-size", "128"], 1, cuda=False)
    assert errors == [] and args.model.hidden_size == 128
