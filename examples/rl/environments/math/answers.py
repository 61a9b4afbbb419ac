r"""Answer extraction and a small normalizer for math answers.

* ``extract_boxed``: the content of the last ``\boxed{...}`` (the backslash is optional, braces
  may nest).
* ``final_answer``: that boxed answer or, when the text has none and boxing is not required, the
  text after the last ``=`` (the whole text if it has no ``=``).
* ``normalize_answer``: a canonical string so that equivalent spellings compare equal:
  ``\dfrac{1}{2}``, ``1/2``, ``0.5``, ``.50`` and ``$\frac12$`` all become ``1/2``; ``1,000`` and
  ``1000.0`` become ``1000``; ``\text{...}`` wrappers, ``\left``/``\right``, LaTeX spacing,
  ``$``, ``%``, degree signs, whitespace and a trailing period are dropped. Anything that is not a
  number is compared as the cleaned-up string.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\?boxed\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_FRAC_BRACED = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\w)\s*(\w)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_DECIMAL = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"  # no exponents: "1e999999999" would be costly
_NUMBER = re.compile(rf"({_DECIMAL})(?:/({_DECIMAL}))?")
_SIMPLE = re.compile(r"[+-]?[\w.]+")
_DROPPED = (
    "\\left",
    "\\right",
    "^{\\circ}",
    "^\\circ",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "\\%",
    "%",
    "\\$",
    "$",
)


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``boxed{...}`` whose braces close; else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def final_answer(text: str, require_boxed: bool = False) -> str | None:
    """The answer a completion gives (see the module docstring), or None if it gives none."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if require_boxed:
        return None
    tail = text.rsplit("=", 1)[-1]
    return tail if tail.strip() else None


def _fraction(numerator: str, denominator: str) -> str:
    simple = _SIMPLE.fullmatch(numerator) and _SIMPLE.fullmatch(denominator)
    return f"{numerator}/{denominator}" if simple else f"({numerator})/({denominator})"


def normalize_answer(text: str) -> str:
    """A canonical form of ``text`` for comparison (see the module docstring)."""
    s = text.strip()
    s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for piece in _DROPPED:
        s = s.replace(piece, "")
    s = re.sub(r"\s+", "", s)
    s = _FRAC_BRACED.sub(lambda m: _fraction(m[1], m[2]), s)
    s = _FRAC_SHORT.sub(lambda m: _fraction(m[1], m[2]), s)
    s = s.rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    number = _NUMBER.fullmatch(s)
    if number:
        value = Fraction(number[1])
        if number[2] is not None:
            denominator = Fraction(number[2])
            if denominator == 0:
                return s
            value /= denominator
        return str(value)
    return s


def answers_match(predicted: str | None, reference: str) -> bool:
    """Whether ``predicted`` and ``reference`` normalize to the same non-empty answer."""
    if predicted is None:
        return False
    normalized = normalize_answer(predicted)
    return normalized != "" and normalized == normalize_answer(reference)
