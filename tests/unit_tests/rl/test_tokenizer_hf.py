"""``HuggingFaceTokenizer`` on the tiny checkpoints' locally trained BPE tokenizers."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron.rl.models.hf import HFCheckpointError
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "What is 12+7?"}]


def test_llama_style_ids_bos_and_round_trip(tiny_hf_checkpoints):
    tok = HuggingFaceTokenizer(tiny_hf_checkpoints["llama"])
    for member in Tokenizer.__annotations__.keys() | {"vocab_size", "encode", "decode"}:
        assert hasattr(tok, member), member  # the Tokenizer protocol
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 300)
    ids = tok.encode("12+7=19")
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert tok.decode(ids) == "12+7=19"


def test_qwen_style_adds_no_bos(tiny_hf_checkpoints):
    tok = HuggingFaceTokenizer(tiny_hf_checkpoints["qwen2"])
    assert tok.encode("7")[0] != tok.bos_id
    assert tok.decode(tok.encode("is 40 > 7? yes")) == "is 40 > 7? yes"


def test_stop_ids_come_from_generation_config_and_decode_stops_there(tiny_hf_checkpoints):
    tok = HuggingFaceTokenizer(tiny_hf_checkpoints["qwen3"])
    assert tok.stop_ids == (2, 3) and tok.extra_stop_ids == (3,)
    body = tok.encode("12")
    assert tok.decode(body + [3] + tok.encode("99")) == "12"
    assert tok.decode(body + [tok.eos_id] + body) == "12"


def test_chat_template_renders_and_encodes_without_a_second_bos(tiny_hf_checkpoints):
    tok = HuggingFaceTokenizer(tiny_hf_checkpoints["llama3"])
    text = tok.apply_chat_template(MESSAGES)
    assert text == "<|bos|><|user|>What is 12+7?<|end|><|assistant|>"
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(HFCheckpointError, match=f"tokenizer directory {tmp_path / 'nope'} does"):
        HuggingFaceTokenizer(tmp_path / "nope")


def test_directory_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(
        HFCheckpointError, match=f"{tmp_path}: cannot load a Hugging Face tokenizer"
    ):
        HuggingFaceTokenizer(tmp_path)


def test_chat_without_a_template_is_refused_by_name(tiny_hf_checkpoints, tmp_path):
    directory = shutil.copytree(tiny_hf_checkpoints["qwen2"], tmp_path / "plain")
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    tok = HuggingFaceTokenizer(directory)
    assert tok.chat_template is None
    with pytest.raises(HFCheckpointError, match=f"{directory}: the tokenizer has no chat_template"):
        tok.apply_chat_template(MESSAGES)
    assert tok.encode("12") == HuggingFaceTokenizer(tiny_hf_checkpoints["qwen2"]).encode("12")
