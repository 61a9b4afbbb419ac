"""Chat episodes (``chat_episode.py``, ``ChatMultiTurnEnvironment``): the row is the generated
tokens plus the template's tokens for the environment's messages (never a re-tokenization),
the seeds and keys, in process == over HTTP, the metrics, and the environment's failures."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.agent.api import Problem
from megatron.rl.agent.chat_episode import ChatTurn, Reply, call_id, run_chat_episode
from megatron.rl.agent.chat_multi_turn import ChatMultiTurnArgs, ChatMultiTurnEnvironment
from megatron.rl.http_client import ClientPool
from megatron.rl.inference.chat_continuation import environment_tokens
from megatron.rl.inference.interface import LocalInferenceInterface, render_chat
from megatron.rl.inference.protocol import GenerationOutput
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.seeding import derive_seed
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tools.parsers import tool_call_parser
from megatron.rl.wire import ChatMessage, GroupedRolloutRequest, InferenceRequest, RolloutKey

SEED, BATCH, INDEX, GROUP = 7, 2, 1, 6
TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tiny_hf_checkpoints):
    return HuggingFaceTokenizer(tiny_hf_checkpoints["llama3"])


class Nudge(ChatMultiTurnEnvironment):
    """Asks for a tool call; answers a call with its arguments, anything else with a nudge (a
    tool error). Ends the episode when the sum of a turn's token ids is even (after turn 0).
    Reward: turns / max_turns."""

    def __init__(self, max_turns: int = 3, delay_s: float = 0.0, fail: bool = False) -> None:
        super().__init__("nudge", ChatMultiTurnArgs(max_turns=max_turns))
        self.delay_s, self.fail = delay_s, fail

    def make_problem(self, rng: random.Random) -> Problem:
        n = rng.randrange(100)
        messages = [{"role": "system", "content": "Use echo."}, {"role": "user", "content": f"{n}"}]
        return Problem(problem_id=f"n:{n}", prompt=None, answer="", max_tokens=3, messages=messages)

    def tools(self, problem):
        return TOOLS

    async def respond(self, problem, turns: list[ChatTurn]) -> Reply | None:
        await asyncio.sleep(self.delay_s * random.random())
        if self.fail:
            raise RuntimeError("the tool server is down")
        last = turns[-1]
        if len(turns) > 1 and sum(last.response.tokens) % 2 == 0:
            return None
        if last.parsed.tool_calls:
            return Reply(
                [
                    ChatMessage(
                        role="tool",
                        content=json.dumps(c.arguments),
                        tool_call_id=call_id(last.turn, i),
                    )
                    for i, c in enumerate(last.parsed.tool_calls)
                ]
            )
        return Reply([ChatMessage(role="user", content="No tool call found.")], tool_errors=1)

    async def reward(self, problem, episode) -> float:
        return len(episode.turns) / self.args.max_turns


def grouped(group_size: int = GROUP) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=BATCH,
        index_in_batch=INDEX,
        groups_in_batch=2,
        group_size=group_size,
        seed=SEED,
        submission_policy_version=1,
    )


class Recording(LocalInferenceInterface):
    """The in-process interface, recording each request and response."""

    def __init__(self, engine, tokenizer) -> None:
        super().__init__(engine, tokenizer)
        self.log: list[tuple[InferenceRequest, object]] = []

    async def generate(self, request):
        response = await super().generate(request)
        self.log.append((request, response))
        return response


def run_group(env, tokenizer, remote: bool = False):
    """The group, the engine's step plans and the in-process request log."""
    steps = FakeSteps()

    async def run():
        engine = ContinuousBatchingScheduler(
            steps, SchedulerConfig(max_requests=8, max_seq_len=256, barrier_timeout_s=5), lambda: 1
        )
        engine.start()
        engine.resume()
        local = Recording(engine, tokenizer)
        pool = ClientPool(
            8, httpx.Timeout(5.0), httpx.ASGITransport(create_inference_app(local, tokenizer))
        )
        inference = RemoteInferenceInterface("http://t", pool) if remote else local
        engine.expect_group(BATCH, INDEX, env.expected_requests(grouped()))
        try:
            group = await asyncio.wait_for(env.group_rollout(grouped(), inference), 10)
        finally:
            engine.group_done(BATCH, INDEX)
            await pool.aclose()
            await engine.aclose()
        return group, local.log

    group, log = asyncio.run(run())
    return group, [[(r.seed, r.start, r.tokens) for r in p.rows[0]] for p in steps.plans], log


def test_a_rollout_is_the_generated_tokens_plus_the_templates_tokens_for_the_replies(tok):
    group, _, log = run_group(Nudge(), tok)
    by_key: dict[int, list] = {}
    for request, response in log:
        by_key.setdefault(request.rollout_key.sample_index, []).append((request, response))
    turns = []
    for k, rollout in enumerate(group.rollouts):
        served = by_key[k]
        first, _ = served[0]
        assert (
            first.seed == derive_seed(derive_seed(SEED, BATCH, INDEX), k) and first.tools == TOOLS
        )
        expected = list(served[0][1].prompt_tokens)
        for t, (request, response) in enumerate(served):
            if t > 0:
                assert request.seed == derive_seed(first.seed, t)
                assert request.prompt_tokens == expected
                expected += environment_tokens(tok, request.suffix_messages, expected, TOOLS)
            assert request.continued == (t + 1 < 3)
            expected += response.tokens
        generated = [t for t, m in zip(rollout.tokens, rollout.generation_mask) if m]
        assert rollout.tokens == expected
        assert generated == [t for _, r in served for t in r.tokens]
        assert rollout.episode_metrics == {
            "turns": len(served),
            "tool_calls": 0.0,
            "tool_errors": len(served) - 1,  # nudges
            "truncated": float(
                len(served) == 3 or any(r.finish_reason == "length" for _, r in served)
            ),
        }
        assert rollout.turn_lengths == [len(r.tokens) for _, r in served]
        assert "user: No tool call found." in rollout.completion
        turns.append(len(served))
    assert len(set(turns)) > 1  # some episodes ended early (end_rollout released the engine)


def test_the_schedule_does_not_depend_on_how_long_the_environment_takes(tok):
    fast = run_group(Nudge(), tok)[:2]
    assert run_group(Nudge(delay_s=0.03), tok)[:2] == fast


def test_over_http_the_group_and_the_schedule_equal_the_in_process_ones(tok):
    assert run_group(Nudge(delay_s=0.01), tok, remote=True)[:2] == run_group(Nudge(), tok)[:2]


def test_a_failing_environment_masks_its_rollouts(tok):
    group, _, _ = run_group(Nudge(fail=True), tok)
    assert all(r.is_placeholder and "tool server is down" in r.error for r in group.rollouts)


class Scripted:
    """An engine that generates given token lists in order (a stand-in for sampling)."""

    counters = None

    def __init__(self, outputs: list[list[int]]) -> None:
        self.outputs = list(outputs)

    async def generate(self, prompt_tokens, sampling, seed, key=None, continued=False):
        tokens = self.outputs.pop(0)
        return GenerationOutput(tokens, [-0.5] * len(tokens), [0] * len(tokens), "stop")

    def end_rollout(self, key) -> bool:
        return False


def split_merge(tok) -> tuple[list[int], str]:
    """Tokens that decode to text the tokenizer encodes differently: the pieces of a merge."""
    for merged in range(tok.vocab_size):
        text = tok.token_text(merged)
        if len(text) < 2 or text.strip() != text or not text.isprintable() or "<" in text:
            continue
        pieces = tok.encode_continuation(text[0]) + tok.encode_continuation(text[1:])
        if tok.decode(pieces) == text and tok.encode_continuation(text) != pieces:
            return pieces, text
    raise AssertionError("the tokenizer has no merge to split")


def test_a_turn_trains_the_sampled_tokens_not_the_re_encoded_text(tok):
    pieces, text = split_merge(tok)
    call = '<tool_call>{"name": "echo", "arguments": {}}</tool_call>'
    end = next(s for s in tok.stop_ids if tok.token_text(s) == "<|end|>")  # the template's
    turn0 = pieces + tok.encode_continuation(call) + [end]
    turn1 = pieces + [end]
    engine = Scripted([turn0, turn1])
    messages = [ChatMessage(role="user", content="go")]
    first = InferenceRequest(
        messages=messages,
        tools=TOOLS,
        rollout_key=RolloutKey(batch_id=0, index_in_batch=0, sample_index=0),
    )
    replies = []

    async def respond(turns):
        assert turns[-1].parsed.tool_calls[0].name == "echo" and turns[-1].parsed.content == text
        replies.append(Reply([ChatMessage(role="tool", content="ok", tool_call_id=call_id(0, 0))]))
        return replies[-1]

    episode = asyncio.run(
        run_chat_episode(
            LocalInferenceInterface(engine, tok), first, 2, respond, tool_call_parser("hermes")
        )
    )
    generated = [t for t, m in zip(episode.tokens, episode.generation_mask) if m]
    assert generated == turn0 + turn1  # exactly the engine's output
    assert episode.metrics == {
        "turns": 2.0,
        "tool_calls": 1.0,
        "tool_errors": 0.0,
        "truncated": 1.0,
    }
    # Rendering the conversation and encoding it again gives other tokens for the same text.
    conversation = [
        *messages,
        ChatMessage(role="assistant", content=tok.decode(turn0)),
        *replies[0].messages,
        ChatMessage(role="assistant", content=tok.decode(turn1)),
    ]
    _, rendered = render_chat(tok, conversation[:-1], TOOLS)
    history = episode.turns[1].response.prompt_tokens  # what turn 1 was generated from
    assert tok.decode(rendered) == tok.decode(history)
    assert rendered != history and tok.encode_continuation(text)[0] in rendered
    start = len(episode.turns[0].response.prompt_tokens)
    assert history[start : start + len(turn0)] == turn0  # the sampled pieces, not the merge


def test_an_assistant_turn_becomes_an_openai_message_with_its_calls(tok):
    parser = tool_call_parser("hermes")
    text = 'thinking <tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>'
    turn = ChatTurn(response=None, parsed=parser.parse(text), turn=3)  # type: ignore[arg-type]
    message = turn.message()
    assert message.content == "thinking" and message.tool_calls[0].id == "call_3_0"
    assert json.loads(message.tool_calls[0].function.arguments) == {"x": 1}
