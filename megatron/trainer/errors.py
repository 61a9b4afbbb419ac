"""The trainer's expected-error types: raised anywhere in the trainer, turned into one message and
an exit status by ``runtime/exits.py`` (no torch, no megatron-core)."""

from __future__ import annotations


class UsageError(SystemExit):
    """Bad flags: ``message`` (argparse's, or every problem ``flags.resolve.resolve`` found) is printed
    as it is, status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class PeerFailed(SystemExit):
    """Raised on the ranks that did not fail when another one did: that rank reports the error,
    these exit quietly with status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message


class RefitMismatch(RuntimeError):
    """``--rl-verify-model-weights-swap`` found an inference copy that differs from the trained
    weights after a refit; the message names the parameters and the policy version."""


class NonFiniteUpdate(RuntimeError):
    """An update was not applied because a loss or the gradient norm is NaN or infinite; the
    message names the ranks and micro-batches (the training loop adds the step)."""


class InferenceRanksFailed(RuntimeError):
    """``--refit-mode non-collocated``: the inference ranks failed (their error, forwarded to
    training rank 0) or ended; the message names them."""
