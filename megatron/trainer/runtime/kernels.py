"""megatron-core's start-up warnings, collected not printed.

megatron-core warns once per module that imports a fallback ("Transformer Engine / Apex is not
installed"), i.e. four or five times before a run starts. ``kernel_warnings()`` wraps the imports
of the entry script; the run's header (``report.header``) says in one line what is missing.

Other notices megatron-core prints on some releases are folded into one header line too
(``notices()``, ``report.notices_line``): ``absl.logging is not installed`` (a ``UserWarning`` at
import where absl-py is missing) and, from 0.19, ``GPTModel IS DEPRECATED`` (a log record at every
``GPTModel`` construction, i.e. after the imports: ``kernel_warnings`` also attaches a filter to
that logger, which stays); torch's CUDA build on a machine without CUDA adds "No CUDA runtime is
found" while megatron-core loads. This module must not import megatron-core.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

_NOT_INSTALLED = re.compile(
    r"(Transformer Engine and Apex|Transformer Engine|Apex) (?:is|are) not installed"
)

_NOTICES = {
    re.compile(r"absl\.logging is not installed"): "absl-py not installed (Python logging instead)",
    re.compile(r"GPTModel IS DEPRECATED"): "GPTModel deprecated upstream in favour of HybridModel",
    re.compile(r"No CUDA runtime is found"): "torch's CUDA build without a CUDA runtime",
}
"""megatron-core message pattern -> the few words of the header's notices line."""

_NOTICE_LOGGERS = ("megatron.core.models.gpt.gpt_model", "torch.utils.cpp_extension")
"""Loggers whose records may carry a notice: megatron-core's ``log_single_rank`` (rank 0) and
torch's, which megatron-core's imports wake on a CPU machine with torch's CUDA build."""

_seen: set[str] = set()


def _notice(message: str) -> str | None:
    return next((note for pattern, note in _NOTICES.items() if pattern.search(message)), None)


class _FoldNotices(logging.Filter):
    """Drops the records of known notices, remembering them for the header."""

    def filter(self, record: logging.LogRecord) -> bool:
        note = _notice(record.getMessage())
        if note is None:
            return True
        _seen.add(note)
        return False


_FILTER = _FoldNotices()


def fold_notices() -> None:
    """Fold megatron-core's known log notices from now on (idempotent)."""
    for name in _NOTICE_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def notices() -> list[str]:
    """The notices folded so far in this process, sorted."""
    return sorted(_seen)


@contextlib.contextmanager
def kernel_warnings() -> Iterator[set[str]]:
    """Collect (instead of printing) megatron-core's "... not installed" warnings; yields the
    names of the missing kernel packages. Known notices are folded (``notices()``, from now on
    for the log records); other warnings pass through."""
    missing: set[str] = set()
    fold_notices()
    with warnings.catch_warnings(record=True) as caught:
        yield missing
    for w in caught:
        match = _NOT_INSTALLED.search(str(w.message))
        note = _notice(str(w.message)) if match is None else None
        if note is not None:
            _seen.add(note)
        elif match is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            missing.update(name.strip() for name in match.group(1).split(" and "))
