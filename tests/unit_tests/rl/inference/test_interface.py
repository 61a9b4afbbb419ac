"""``LocalInferenceInterface`` with chat messages: rendered by the tokenizer's chat template (with
the assistant's generation prompt), refused by name when the tokenizer has none."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse, SamplingParams

MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12+7?"},
]


def generate(tokenizer, request: InferenceRequest) -> InferenceResponse:
    """``request`` through a ``LocalInferenceInterface`` over a running engine (fake steps)."""

    async def run():
        engine = ContinuousBatchingScheduler(
            FakeSteps(), SchedulerConfig(max_requests=2, max_seq_len=96), lambda: 4
        )
        engine.start()
        engine.resume()
        try:
            return await LocalInferenceInterface(engine, tokenizer).generate(request)
        finally:
            await engine.aclose()

    return asyncio.run(run())


def chat(**overrides) -> InferenceRequest:
    return InferenceRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=3), **overrides)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_messages_are_rendered_with_the_generation_prompt(tiny_hf_checkpoints, family):
    tokenizer = HuggingFaceTokenizer(tiny_hf_checkpoints[family])
    out = generate(tokenizer, chat(seed=2))
    bos = "<|bos|>" if family == "llama3" else ""
    expected = (
        f"{bos}<|system|>Answer with a number.<|end|><|user|>What is 12+7?<|end|><|assistant|>"
    )
    assert out.prompt_text == expected
    assert out.prompt_tokens == tokenizer.encode_chat(MESSAGES)
    assert out.prompt_tokens.count(tokenizer.bos_id) == (1 if bos else 0)
    assert out.policy_versions == [4] * len(out.tokens)


def test_text_prompts_have_no_rendered_prompt(tiny_hf_checkpoints):
    tokenizer = HuggingFaceTokenizer(tiny_hf_checkpoints["qwen2"])
    out = generate(
        tokenizer, InferenceRequest(prompt="12+7=", sampling=SamplingParams(max_tokens=2))
    )
    assert out.prompt_text is None and out.prompt_tokens == tokenizer.encode("12+7=")


def test_character_tokenizer_refuses_messages_naming_them():
    with pytest.raises(InvalidInferenceRequest) as info:
        generate(CharTokenizer(), chat())
    assert str(info.value).startswith(
        "messages: the tokenizer (CharTokenizer) has no chat template, so a prompt given as chat "
        "messages cannot be rendered"
    )


def test_hf_tokenizer_without_a_template_refuses_messages(tiny_hf_checkpoints, tmp_path):
    directory = shutil.copytree(tiny_hf_checkpoints["qwen2"], tmp_path / "plain")
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(InvalidInferenceRequest, match=r"HuggingFaceTokenizer\) has no chat templ"):
        generate(HuggingFaceTokenizer(directory), chat())


def test_a_template_that_refuses_the_conversation_is_an_invalid_request(
    tiny_hf_checkpoints, tmp_path
):
    directory = shutil.copytree(tiny_hf_checkpoints["qwen2"], tmp_path / "strict")
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
    (directory / "chat_template.jinja").write_text(template + "{% endif %}x")
    with pytest.raises(InvalidInferenceRequest, match="chat template cannot render them: no sys"):
        generate(HuggingFaceTokenizer(directory), chat())
