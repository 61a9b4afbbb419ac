"""A teacher behind our inference server (``--distill-teacher URL``): each rollout scored through
``/v1/completions`` with echo gives the logprobs of a plain forward of the teacher model; a server
that is not there ends with one message naming it."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.hf_engine import load_hf_policy, serve_on_port
from grpo_testing.hf_models import full_logits
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import one_rank_context
from megatron.core import parallel_state

from megatron.rl.http_client import RetryPolicy
from megatron.trainer.flags.distill import is_server_url
from megatron.trainer.train.remote_teacher import RemoteTeacher


@pytest.fixture
def llama3(single_rank_world, tiny_hf_checkpoints):
    return load_hf_policy(tiny_hf_checkpoints["llama3"])


def test_each_row_is_scored_as_a_plain_forward_of_the_teacher(llama3):
    model, tokenizer = llama3
    data = build_train_batch(synthetic_groups(2, 3, tokenizer.vocab_size, seed=4), pad_id=0)
    teacher = RemoteTeacher("http://unused", None, one_rank_context())

    async def work(url: str):
        teacher.base_url = url
        return await asyncio.to_thread(teacher.get_teacher_logprobs, data)

    got = asyncio.run(serve_on_port(model, tokenizer, work, max_seq_len=32))
    assert got.argmax is None and got.topk_ids is None
    assert got.logprobs.shape == data.input_ids.shape
    logits = full_logits(model, data.input_ids, tokenizer.vocab_size)  # (B, T, V)
    want = torch.log_softmax(logits.float(), -1).gather(-1, data.target_ids[..., None])[..., 0]
    real = torch.arange(data.input_ids.shape[1])[None] < data.lengths[:, None]
    torch.testing.assert_close(got.logprobs[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.all(got.logprobs[~real] == 0)  # past each row's length


def test_a_server_that_is_not_there_ends_with_one_message_naming_it(single_rank_world):
    parallel_state.initialize_model_parallel()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    data = build_train_batch(synthetic_groups(1, 2, 32, seed=1), pad_id=0)
    teacher = RemoteTeacher(url, None, one_rank_context(), RetryPolicy(max_retries=0))
    with pytest.raises(RuntimeError, match=f"--distill-teacher {url}: scoring failed"):
        teacher.get_teacher_logprobs(data)
    with pytest.raises(ValueError, match="a remote teacher has no top-k"):
        teacher.get_teacher_logprobs(data, topk=4)


@pytest.mark.parametrize(
    "teacher, remote",
    [
        pytest.param("http://teacher:8000", True, id="http"),
        pytest.param("https://teacher", True, id="https"),
        pytest.param("/models/teacher", False, id="directory"),
    ],
)
def test_a_url_names_a_server(teacher, remote):
    assert is_server_url(teacher) == remote
