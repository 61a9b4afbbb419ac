"""File-backed environments and their held-out validation split (NeMo-RL's validation set).

A ``DatasetEnvironment`` is a single-turn environment over a finite list of problems (a JSONL or
Parquet file): it says how many problems it has and builds problem i. Training draws a problem
uniformly, with replacement, from an RNG seeded by the request (as every single-turn environment
does). ``hold_out`` splits the list once, before the run: a fixed share of the problems becomes
the *validation partition* and training draws only from the rest, so no validation prompt is
ever trained on. Evaluation requests (``request.eval_prompts`` set) take validation problem
``request.batch_id``: each held-out problem once, in the split's order, without replacement.

The split is a pure function of the number of problems, the share and ``SPLIT_SEED`` (not of the
run seed), so runs with different seeds validate on the same problems. Without ``hold_out`` the
environment draws exactly as before (the same RNG calls over the whole list).
"""

from __future__ import annotations

import random
from abc import abstractmethod

from megatron.rl.agent.api import Problem, SingleTurnEnvironment
from megatron.rl.wire import GroupedRolloutRequest

SPLIT_SEED = 0x76616C  # "val": the held-out split's permutation, the same for every run seed


def split_indices(
    num_problems: int, fraction: float, seed: int = SPLIT_SEED
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(training, validation) indices of ``num_problems`` problems with ``fraction`` held out.

    round(fraction x num_problems) problems, chosen by a permutation seeded by ``seed``, form the
    validation partition (in permutation order); the others, in file order, are trained on. Both
    partitions must be non-empty.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {fraction}")
    held_out = round(fraction * num_problems)
    if not 1 <= held_out <= num_problems - 1:
        raise ValueError(
            f"holding out {fraction} of {num_problems} problems leaves {held_out} for validation "
            f"and {num_problems - held_out} for training; both need at least one"
        )
    order = list(range(num_problems))
    random.Random(seed).shuffle(order)
    validation = tuple(order[:held_out])
    chosen = set(validation)
    return tuple(i for i in range(num_problems) if i not in chosen), validation


class DatasetEnvironment(SingleTurnEnvironment):
    """A single-turn environment over a finite list of problems (see the module docstring)."""

    _training: tuple[int, ...] | None = None
    _validation: tuple[int, ...] = ()

    @abstractmethod
    def num_problems(self) -> int:
        """How many problems the data set holds."""

    @abstractmethod
    def problem(self, index: int) -> Problem:
        """Problem ``index`` (0 <= index < ``num_problems()``)."""

    def hold_out(self, fraction: float, seed: int = SPLIT_SEED) -> None:
        """Hold ``fraction`` of the problems out of training, as the validation partition."""
        try:
            self._training, self._validation = split_indices(self.num_problems(), fraction, seed)
        except ValueError as err:
            raise ValueError(f"environment {self.env_id!r}: {err}") from None

    @property
    def validation_indices(self) -> tuple[int, ...]:
        """The held-out problems, in validation order (empty without ``hold_out``)."""
        return self._validation

    @property
    def training_indices(self) -> tuple[int, ...]:
        """The problems training draws from (all of them without ``hold_out``)."""
        return self._training if self._training is not None else tuple(range(self.num_problems()))

    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one training problem uniformly (with replacement)."""
        if self._training is None:
            return self.problem(rng.randrange(self.num_problems()))
        return self.problem(self._training[rng.randrange(len(self._training))])

    def problem_for(self, request: GroupedRolloutRequest) -> Problem:
        """Validation problem ``batch_id`` for an evaluation request when problems are held
        out; a drawn training problem otherwise."""
        if request.eval_prompts is None or not self._validation:
            return super().problem_for(request)
        if not 0 <= request.batch_id < len(self._validation):
            raise ValueError(
                f"validation problem {request.batch_id} asked for; {self.env_id!r} holds out "
                f"{len(self._validation)}"
            )
        return self.problem(self._validation[request.batch_id])
