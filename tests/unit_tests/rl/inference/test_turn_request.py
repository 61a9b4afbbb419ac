"""``turn_request``: the one keyed request scheme of a multi-turn rollout's turns (text and chat
episodes, agent sessions)."""

from __future__ import annotations

import pytest

from megatron.rl.inference.interface import turn_request
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import ChatMessage, InferenceResponse, RolloutKey, SamplingParams

KEY = RolloutKey(batch_id=3, index_in_batch=1, sample_index=2)
SAMPLING = SamplingParams(max_tokens=4)
USER = [ChatMessage(role="user", content="1+1=")]
LAST = InferenceResponse(
    prompt_tokens=[5, 6],
    tokens=[7, 1],
    text="2",
    logprobs=[-0.5, -0.1],
    policy_versions=[0, 0],
    finish_reason="stop",
)


def turn(new, last, number: int, max_turns: int = 3, key: RolloutKey | None = KEY):
    return turn_request(
        new, last, turn=number, max_turns=max_turns, sampling=SAMPLING, seed=11, key=key
    )


def test_turn_0_is_the_conversation_with_the_rollouts_own_seed():
    request = turn(USER, None, 0)
    assert request.messages == USER and request.prompt_tokens is None
    assert (request.seed, request.rollout_key, request.continued) == (11, KEY, True)


@pytest.mark.parametrize(
    "new, field", [("tool says 2", "prompt_suffix"), (USER, "suffix_messages")]
)
def test_a_later_turn_continues_the_previous_tokens_with_the_answer(new, field):
    request = turn(new, LAST, 1)
    assert request.prompt_tokens == [5, 6, 7, 1] and getattr(request, field) == new
    assert (request.seed, request.sampling) == (derive_seed(11, 1), SAMPLING)


def test_the_last_turn_and_unkeyed_turns_are_not_continued():
    assert not turn(USER, LAST, 2).continued
    assert not turn(USER, LAST, 1, key=None).continued


def test_turn_0_needs_chat_messages():
    with pytest.raises(ValueError, match="turn 0 .* chat messages"):
        turn("text", None, 0)
