"""megatron-core's "Transformer Engine / Apex is not installed" warnings, collected not printed.

megatron-core warns once per module that imports a fallback, i.e. four or five times before a run
starts. ``kernel_warnings()`` wraps the imports of the entry script; the run's header
(``report.header``) says in one line what is missing. This module must not import megatron-core.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

_NOT_INSTALLED = re.compile(
    r"(Transformer Engine and Apex|Transformer Engine|Apex) (?:is|are) not installed"
)


@contextlib.contextmanager
def kernel_warnings() -> Iterator[set[str]]:
    """Collect (instead of printing) megatron-core's "... not installed" warnings; yields the
    names of the missing kernel packages. Other warnings pass through."""
    missing: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        yield missing
    for w in caught:
        match = _NOT_INSTALLED.search(str(w.message))
        if match is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            missing.update(name.strip() for name in match.group(1).split(" and "))
