"""The guess-the-number example: feedback, reward, problems, and whole episodes against a scripted
player that binary-searches (so every turn and answer can be checked)."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from examples.rl.environments.guess import (
    GuessArgs,
    GuessEnvironment,
    feedback,
    guess_reward,
    parse_guess,
)
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import GroupedRolloutRequest, InferenceRequest, InferenceResponse

TOK = CharTokenizer()


@pytest.mark.parametrize(
    "completion, expected",
    [("7", 7), (" 3 ", 3), ("0", 0), ("", None), ("+", None), ("12", None), ("-1", None)],
)
def test_parse_guess(completion, expected):
    assert parse_guess(completion, 0, 9) == expected


@pytest.mark.parametrize(
    "completion, answer", [("3", "+"), ("9", "-"), ("5", None), ("+", None), ("", None)]
)
def test_feedback_says_higher_or_lower_and_ends_on_a_hit_or_a_forfeit(completion, answer):
    assert feedback(5, completion, 0, 9) == answer


@pytest.mark.parametrize(
    "completions, reward",
    [
        (["5"], 1.0),
        (["2", "5"], 0.9),
        (["2", "7", "9", "5"], 0.7),
        (["1", "2", "3", "4"], 0.0),
        (["+"], 0.0),
    ],
)
def test_earlier_right_guesses_earn_more(completions, reward):
    assert guess_reward(5, completions, 0, 9, turn_penalty=0.1) == pytest.approx(reward)


def test_args_are_checked():
    with pytest.raises(ValidationError, match="low must not exceed high"):
        GuessArgs(low=5, high=4)
    with pytest.raises(ValidationError, match="cannot write 10"):
        GuessArgs(high=10, guess_tokens=1)


def test_problems_are_seeded_uniform_and_fit_the_default_sequence_length():
    env = GuessEnvironment("guess", GuessArgs())
    secrets = [int(env.make_problem(random.Random(derive_seed(1, i))).answer) for i in range(500)]
    assert set(secrets) == set(range(10))
    problem = env.make_problem(random.Random(3))
    assert problem == env.make_problem(random.Random(3))
    episode = TOK.encode(problem.prompt + "5+8-7")  # raises on a character outside the alphabet
    longest = len(TOK.encode(problem.prompt)) + 4 * problem.max_tokens + 3  # 4 guesses, 3 answers
    assert len(episode) == 9 and longest == 11 <= 32


class BinarySearcher(InferenceInterface):
    """Plays from the history it is sent: the middle of the interval the answers leave open."""

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        if request.prompt is not None:
            prompt = TOK.encode(request.prompt)
        else:
            prompt = list(request.prompt_tokens) + TOK.encode(request.prompt_suffix)
        text = TOK.decode(prompt)
        low, high = 0, 9
        for guess, answer in zip(text[4::2], text[5::2]):
            if answer == "+":
                low = int(guess) + 1
            elif answer == "-":
                high = int(guess) - 1
        tokens = TOK.encode(str((low + high) // 2))
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=tokens,
            text=TOK.decode(tokens),
            logprobs=[-0.5],
            policy_versions=[0],
            finish_reason="length",
        )


def test_a_binary_searcher_finds_every_secret_within_four_guesses():
    env = GuessEnvironment("guess", GuessArgs())

    async def play(batch_id: int):
        request = GroupedRolloutRequest(
            batch_id=batch_id,
            index_in_batch=0,
            groups_in_batch=1,
            group_size=2,
            seed=9,
            submission_policy_version=0,
        )
        return await env.group_rollout(request, BinarySearcher())

    groups = [asyncio.run(play(b)) for b in range(60)]
    by_secret = {}
    for group in groups:
        rollout = group.rollouts[0]
        secret = int(rollout.problem_id.rsplit(":", 1)[1])
        by_secret[secret] = rollout
        turns = sum(rollout.generation_mask)
        assert rollout.reward == pytest.approx(1 - 0.1 * (turns - 1)) and rollout.error is None
        assert (
            rollout.prompt == "0-9:" and TOK.decode(rollout.tokens) == "0-9:" + rollout.completion
        )
    assert sorted(by_secret) == list(range(10))
    assert by_secret[4].completion == "4" and by_secret[9].completion == "4+7+8+9"
    assert by_secret[0].completion == "4-1-0"


def test_a_forfeit_ends_the_game_unsolved():
    class Forfeits(BinarySearcher):
        async def generate(self, request):
            response = await super().generate(request)
            if request.prompt is None:  # the second guess is not a digit
                return response.model_copy(update={"tokens": [TOK.eos_id], "text": ""})
            return response

    env = GuessEnvironment("guess", GuessArgs())
    request = GroupedRolloutRequest(
        batch_id=4,
        index_in_batch=0,
        groups_in_batch=1,
        group_size=1,
        seed=9,
        submission_policy_version=0,
    )
    (rollout,) = asyncio.run(env.group_rollout(request, Forfeits())).rollouts
    assert rollout.problem_id == "guess:0-9:3"  # the first guess, 4, is wrong: "-"
    assert rollout.completion == "4-" and rollout.reward == 0.0
    assert rollout.generation_mask[-2:] == [False, True]  # the forfeiting EOS is the last token
