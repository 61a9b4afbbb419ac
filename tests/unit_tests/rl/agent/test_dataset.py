"""File-backed environments: the held-out validation split and how problems are drawn from it."""

from __future__ import annotations

import random

import pytest

from megatron.rl.agent.api import Problem
from megatron.rl.agent.dataset import SPLIT_SEED, DatasetEnvironment, split_indices
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import GroupedRolloutRequest


class NumberedProblems(DatasetEnvironment):
    """Problem i asks for the number i (its answer)."""

    def __init__(self, count: int) -> None:
        super().__init__("numbers")
        self.count = count

    def num_problems(self) -> int:
        return self.count

    def problem(self, index: int) -> Problem:
        return Problem(problem_id=f"p{index}", prompt=f"{index}=", answer=str(index))

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion == problem.answer)


def request(batch: int, index: int = 0, seed: int = 7, eval_prompts: int | None = None):
    return GroupedRolloutRequest(
        batch_id=batch,
        index_in_batch=index,
        groups_in_batch=8,
        group_size=2,
        seed=seed,
        submission_policy_version=0,
        eval_prompts=eval_prompts,
    )


@pytest.mark.parametrize(
    "count, fraction, held_out",
    [
        pytest.param(8, 0.25, 2, id="quarter-of-8"),
        pytest.param(20, 0.1, 2, id="tenth-of-20"),
        pytest.param(3, 0.5, 2, id="half-of-3"),
        pytest.param(1000, 0.05, 50, id="5-percent-of-1000"),
    ],
)
def test_the_split_is_a_disjoint_partition_of_the_stated_size(count, fraction, held_out):
    training, validation = split_indices(count, fraction)
    assert len(validation) == held_out and len(set(validation)) == held_out
    assert not set(training) & set(validation)
    assert sorted(training + validation) == list(range(count))
    assert list(training) == sorted(training)  # training keeps the file order


def test_the_split_is_deterministic_and_depends_on_its_seed_only():
    assert split_indices(100, 0.2) == split_indices(100, 0.2) == split_indices(100, 0.2, SPLIT_SEED)
    assert split_indices(100, 0.2, seed=1) != split_indices(100, 0.2)


@pytest.mark.parametrize(
    "count, fraction, message",
    [
        pytest.param(8, 0.0, r"must be in \(0, 1\), got 0.0", id="zero"),
        pytest.param(8, 1.0, r"must be in \(0, 1\), got 1.0", id="one"),
        pytest.param(4, 0.1, "leaves 0 for validation and 4 for training", id="none-held-out"),
        pytest.param(4, 0.9, "leaves 4 for validation and 0 for training", id="nothing-to-train"),
    ],
)
def test_unusable_splits_are_refused(count, fraction, message):
    with pytest.raises(ValueError, match=message):
        split_indices(count, fraction)


def test_a_refused_split_names_the_environment():
    with pytest.raises(ValueError, match="environment 'numbers': holding out 0.1 of 4 problems"):
        NumberedProblems(4).hold_out(0.1)


def test_training_never_draws_a_held_out_problem():
    env = NumberedProblems(10)
    env.hold_out(0.3)
    held_out = {f"p{i}" for i in env.validation_indices}
    assert len(held_out) == 3
    drawn = {env.problem_for(request(b, i)).problem_id for b in range(200) for i in range(8)}
    assert drawn == {f"p{i}" for i in env.training_indices}  # every training problem, no other


def test_validation_takes_each_held_out_problem_once_in_order():
    env = NumberedProblems(10)
    env.hold_out(0.3)
    n = len(env.validation_indices)
    chosen = [env.problem_for(request(i, seed=99, eval_prompts=n)).problem_id for i in range(n)]
    assert chosen == [f"p{i}" for i in env.validation_indices]  # no replacement, any seed
    with pytest.raises(ValueError, match="validation problem 3 asked for; 'numbers' holds out 3"):
        env.problem_for(request(3, eval_prompts=n))


def test_without_a_split_the_draws_are_those_of_a_plain_environment():
    env = NumberedProblems(10)
    for b in range(20):
        rng = random.Random(derive_seed(7, b, 0))
        assert env.problem_for(request(b)).problem_id == f"p{rng.randrange(10)}"
    assert env.validation_indices == () and env.training_indices == tuple(range(10))
