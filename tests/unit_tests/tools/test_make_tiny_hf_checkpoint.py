"""tools/make_tiny_hf_checkpoint.py: the flags reach the checkpoint; the corpus trains the BPE."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron.rl.models.hf import read_hf_config
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location(
    "make_tiny_hf_checkpoint", ROOT / "tools" / "make_tiny_hf_checkpoint.py"
)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_flags_and_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["banana split", "banana bread"] * 50))
    out = tmp_path / "ckpt"
    tool.main(
        ["--family", "qwen2", "--out", str(out), "--hidden-size", "32", "--num-layers", "1"]
        + ["--vocab-size", "320", "--tokenizer-corpus", str(corpus)]
    )
    hf = read_hf_config(out)
    assert (hf.family, hf.arch.hidden_size, hf.arch.num_layers, hf.vocab_size) == (
        "qwen2",
        32,
        1,
        320,
    )
    tok = HuggingFaceTokenizer(out)
    assert len(tok.encode("banana")) == 1  # merged by training on the corpus
    assert len(tok.encode("12345")) > 1  # digits are not in this corpus
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]


@pytest.mark.parametrize(
    "argv, positions",
    [
        pytest.param([], 4096, id="default-fits-the-readme-seq-length"),
        pytest.param(["--max-position-embeddings", "1024"], 1024, id="flag"),
    ],
)
def test_max_position_embeddings(tmp_path, argv, positions):
    out = tmp_path / "ckpt"
    tool.main(["--family", "qwen2", "--out", str(out), "--num-layers", "1", *argv])
    assert read_hf_config(out).arch.max_position_embeddings == positions


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        tool.main(["--family", "gpt2", "--out", str(tmp_path)])


def test_reward_model(tmp_path):
    import transformers

    out = tmp_path / "rm"
    tool.main(["--family", "llama3", "--reward-model", "--num-labels", "2", "--out", str(out)])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.num_labels == 2
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template
