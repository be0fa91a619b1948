"""``math``: the built-in verifier of math answers (the rules are in the package docstring)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from rollstream.common.errors import RewardError
from rollstream.common.models import PromptContent, Reward, Sample

from .base import RewardFunction

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_PHRASE = re.compile(r"####|\banswer\s*(?:is\b|:)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.;!?](?=\s|$)|,\s")
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_VARIABLE_PREFIX = re.compile(r"^[a-z]\w*\s*=\s*(?=\S)", re.IGNORECASE)
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?", re.IGNORECASE)
_RATIO = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))/([+-]?(?:\d+(?:\.\d*)?|\.\d+))")
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"([+-]?)\\frac(\d)(\d)")
_LEADING_NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_MAX_NUMBER_CHARS = 200


def _boxed_content(text: str, start: int) -> str | None:
    """The argument of a ``\\boxed`` ending at ``start``: ``{...}`` (balanced) or one token."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    depth = 0
    j = i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None  # unbalanced: the response was cut inside the box


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None: last ``\\boxed{}``, else last answer phrase."""
    if not isinstance(text, str) or not text:
        return None
    for match in reversed(list(_BOXED.finditer(text))):
        content = _boxed_content(text, match.end())
        if content is not None and content.strip():
            return content.strip()
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if not phrases:
        return None
    rest = text[phrases[-1].end() :]
    lines = [line.strip(" \t*_:") for line in rest.split("\n")]
    # "The answer is:\n42" -> the next non-empty line
    candidate = next((line for line in lines if line), "")
    cut = _SENTENCE_END.search(candidate)
    if cut is not None:
        candidate = candidate[: cut.start()]
    candidate = candidate.strip(" \t*_")
    return candidate or None


def _normalize_text(value: str) -> str:
    s = value.replace("\u2212", "-")
    previous = None
    while previous != s:
        previous = s
        s = _TEXT_WRAPPER.sub(r"\1", s)
    for old, new in (
        ("\\$", ""),
        ("$", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", " "),
        ("\\left", ""),
        ("\\right", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\%", "%"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\u00b0", ""),
    ):
        s = s.replace(old, new)
    s = " ".join(s.split()).strip()
    while s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _boxed_content(s, 0) == s[1:-1]:
        s = s[1:-1].strip()
    return s.lower()


def _parse_number(value: str) -> Fraction | None:
    """A normalised answer as an exact fraction, or None when it is not a plain number."""
    s = _VARIABLE_PREFIX.sub("", value).replace(" ", "")
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    if s.endswith("%"):
        s = s[:-1]
    frac = _FRAC.fullmatch(s) or _FRAC_SHORT.fullmatch(s)
    if frac is not None:
        numerator = _parse_number(frac.group(2))
        denominator = _parse_number(frac.group(3))
        if numerator is None or denominator is None or denominator == 0:
            return None
        result = numerator / denominator
        return -result if frac.group(1) == "-" else result
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        ratio = _RATIO.fullmatch(s)
        if ratio is not None:
            denominator_value = Fraction(ratio.group(2))
            if denominator_value == 0:
                return None
            return Fraction(ratio.group(1)) / denominator_value
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _answer_number(normalised: str) -> Fraction | None:
    number = _parse_number(normalised)
    if number is not None:
        return number
    # "42 apples", "5 cm": a leading number followed by words without any digit
    leading = _LEADING_NUMBER.match(normalised)
    if leading is not None and not re.search(r"\d", normalised[leading.end() :]):
        return _parse_number(leading.group(0))
    return None


def _numbers_close(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    except OverflowError:
        return False


def _label_text(label: Any) -> str:
    if isinstance(label, bool):
        return str(label)
    if isinstance(label, numbers.Integral):
        return str(int(label))
    if isinstance(label, numbers.Real):
        return repr(float(label))
    text = str(label)
    if "\\boxed" in text or "####" in text:  # a full reference solution: take its answer
        text = extract_answer(text) or text
    return text


def answers_match(answer: str, label: Any) -> bool:
    """Whether an extracted answer equals the label (numerically, else as normalised text)."""
    if label is None:
        return False
    norm_answer = _normalize_text(answer)
    if isinstance(label, numbers.Real) and not isinstance(label, bool):
        if isinstance(label, float) and not math.isfinite(label):
            return False
        label_number: Fraction | None = (
            Fraction(int(label)) if isinstance(label, numbers.Integral) else Fraction(float(label))
        )
        norm_label = _normalize_text(_label_text(label))
    else:
        norm_label = _normalize_text(_label_text(label))
        label_number = _answer_number(norm_label)
    answer_number = _answer_number(norm_answer)
    if answer_number is not None and label_number is not None:
        return _numbers_close(answer_number, label_number)
    return norm_answer == norm_label


def math_reward(response: str, label: Any) -> float:
    """1.0 when the final answer of ``response`` matches ``label``, else 0.0."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, label) else 0.0


class MathReward(RewardFunction):
    """The ``"math"`` reward: :func:`math_reward` of every sample's response."""

    name = "math"

    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> list[Reward]:
        if label is None:
            raise RewardError("the math reward needs a label, but the prompt has none")
        return [math_reward(sample.response, label) for sample in samples]
