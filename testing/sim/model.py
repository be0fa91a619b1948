"""The simulator's "model": the toy byte tokenizer, the arithmetic it answers, the response plan
(filler, answer, scripted tool calls), the routing replay and the teacher's log-probs. Pure
functions of the text and a seeded RNG; no HTTP, no state (the behaviour is documented in
:mod:`rollstream.testing.sim.simulator`)."""

from __future__ import annotations

import ast
import base64
import math
import operator
import random
import re
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MODEL_NAME = "rollstream-sim"
MAX_MODEL_LEN = 32768
POISON_MARKER = "POISON"

_FILLER_WORDS = (
    "let", "me", "think", "about", "this", "carefully", "first", "we", "compute", "the",
    "value", "then", "check", "it", "again", "so", "step", "by", "and", "now", "result", "is",
    "clear", "hmm", "wait", "okay", "right", "simplify", "expression", "carry", "sum",
)  # fmt: skip


@dataclass(frozen=True)
class SimConfig:
    """Behaviour of the simulated engine."""

    seed: int = 0
    """Seed of the random lengths, answers and log-probs (one seed, one run)."""
    accuracy: float = 0.7
    """Probability that the boxed answer is correct (0..1)."""
    mean_tokens: int = 64
    """Mean response length in tokens (log-normal), >= 1."""
    length_sigma: float = 0.5
    """Log-normal sigma of the response length; 0 gives a fixed length."""
    max_tokens_cap: int = 16384
    """Upper clip of the drawn response length."""
    latency_per_token: float = 0.0
    """Seconds per generated token."""
    base_latency: float = 0.0
    """Seconds per request, before the first token."""
    max_running: int = 64
    """Requests generated concurrently; more wait in a queue."""
    weight_version: int = 0
    """Initial weight version."""
    report_weight_version: bool = True
    """Whether ``/generate`` replies include ``meta_info.weight_version``."""
    moe: tuple[int, int, int] | None = None
    """``(layers, topk, experts)`` of the routing replay answered to ``return_routed_experts``."""
    prefix_cache_tokens: int = 0
    """Capacity of the prefix cache in tokens (whole :data:`CACHE_BLOCK` blocks, LRU); 0: none."""
    prefill_per_token: float = 0.0
    """Seconds per prompt token not found in the prefix cache, before the first output token."""
    deterministic: bool = False
    """Each reply is a function of ``seed`` and the request's input alone (not of the requests
    before it): two runs that send the same requests get the same tokens (``bench durable``'s
    token-for-token comparison of a killed and an uninterrupted run)."""
    kv_capacity_tokens: int = 0
    """KV memory in tokens (prompt + output of every running request); 0: unlimited. With a
    capacity, requests are scheduled in steps as vLLM's scheduler does: admitted while their
    tokens fit, the newest running one preempted (its tokens recomputed later, at
    ``prefill_per_token``, stalling the whole batch) when the running ones outgrow it."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError(f"accuracy must be within [0, 1], got {self.accuracy}")
        if self.mean_tokens < 1:
            raise ValueError(f"mean_tokens must be >= 1, got {self.mean_tokens}")
        if not math.isfinite(self.length_sigma) or self.length_sigma < 0:
            raise ValueError(f"length_sigma must be >= 0, got {self.length_sigma}")
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        for name in ("latency_per_token", "base_latency"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.weight_version < 0:
            raise ValueError(f"weight_version must be >= 0, got {self.weight_version}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.kv_capacity_tokens < 0:
            raise ValueError(f"kv_capacity_tokens must be >= 0, got {self.kv_capacity_tokens}")
        if not math.isfinite(self.prefill_per_token) or self.prefill_per_token < 0:
            raise ValueError(f"prefill_per_token must be a finite number >= 0, got {self.prefill_per_token}")


def routed_expert(token_id: int, layer: int, k: int, experts: int) -> int:
    """The expert the simulator routes ``token_id`` to at ``layer``, choice ``k``."""
    return (token_id * 31 + layer * 7 + k * 13) % experts


def teacher_logprob(previous: int, token_id: int) -> float:
    """The simulated teacher's log-prob of ``token_id`` after ``previous`` (float32-exact)."""
    return -((previous * 131 + token_id) % 997 + 1) / 1024


def _routed_experts_b64(tokens: Sequence[int], moe: tuple[int, int, int]) -> str:
    layers, topk, experts = moe
    out = array("i")
    cache: dict[int, list[int]] = {}
    for token in tokens[: max(0, len(tokens) - 1)]:
        ids = cache.get(token)
        if ids is None:
            ids = [routed_expert(token, layer, k, experts) for layer in range(layers) for k in range(topk)]
            cache[token] = ids
        out.extend(ids)
    if sys.byteorder != "little":  # pragma: no cover
        out.byteswap()
    return base64.b64encode(out.tobytes()).decode("ascii")


def _routed_experts_npy_b64(tokens: Sequence[int], moe: tuple[int, int, int]) -> str:
    """vLLM's form of the same replay: base64 of a ``.npy`` buffer (format 1.0, C order) of shape
    ``(tokens - 1, layers, topk)`` in the narrowest dtype holding the expert ids, as vLLM's
    ``numpy2base64`` writes it."""
    layers, topk, experts = moe
    code, descr = ("B", "|u1") if experts <= 256 else ("H", "<u2") if experts <= 65536 else ("i", "<i4")
    rows = max(0, len(tokens) - 1)
    out = array(code, [routed_expert(t, layer, k, experts) for t in tokens[:rows] for layer in range(layers)
                       for k in range(topk)])
    if sys.byteorder != "little":  # pragma: no cover
        out.byteswap()
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {layers}, {topk}), }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"  # numpy pads the preamble to 64 bytes
    npy = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin-1") + out.tobytes()
    return base64.b64encode(npy).decode("ascii")


def _teacher_reply(input_ids: list[int], start: int) -> dict[str, Any]:
    entries = [
        [None if i == 0 else teacher_logprob(input_ids[i - 1], input_ids[i]), input_ids[i], None]
        for i in range(max(0, start), len(input_ids))
    ]
    return {
        "text": "", "output_ids": [],
        "meta_info": {"finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(input_ids),
                      "completion_tokens": 0, "input_token_logprobs": entries},
    }


# --------------------------------------------------------------------------- toy tokenizer


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (ids 0..255)."""
    return list(text.encode("utf-8"))


def detokenize(ids: Sequence[int]) -> str:
    """Text of token ids: the bytes ``id & 0xFF`` decoded as UTF-8 (invalid bytes replaced)."""
    return bytes(i & 0xFF for i in ids).decode("utf-8", "replace")


# --------------------------------------------------------------------------- the "model"

_EXPR_RUN = re.compile(r"[0-9\s+\-*/()]+")
_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_MAGNITUDE = 10**18


def _eval_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        result = _BINOPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
        if abs(result) > _MAX_MAGNITUDE:
            raise ValueError("value too large")
        return result
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def _has_binop(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) for n in ast.walk(node))


def _as_number(value: Fraction) -> int | float:
    if value.denominator == 1:
        return int(value)
    return round(float(value), 2)


def _last_expression(text: str) -> tuple[str, int | float] | None:
    """The last arithmetic expression in ``text`` and its value (None when there is none)."""
    for match in reversed(list(_EXPR_RUN.finditer(text))):
        candidate = match.group().strip()
        if not any(c.isdigit() for c in candidate) or len(candidate) > 1000:
            continue
        try:
            tree = ast.parse(candidate, mode="eval")
            if not _has_binop(tree):
                continue
            return candidate, _as_number(_eval_node(tree))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
            continue
    return None


def evaluate_last_expression(text: str) -> int | float | None:
    """Value of the last arithmetic expression in ``text`` (``None`` when there is none).

    An expression is a run of digits, spaces, ``+ - * / ( )`` with at least one binary
    operator; it is evaluated exactly over the rationals without ``eval``. An integral result
    is an ``int``, any other a ``float`` rounded to 2 decimals.
    """
    found = _last_expression(text)
    return None if found is None else found[1]


TOOL_MARKER = re.compile(r"\[tools=(\d+)(?::([A-Za-z_]\w*))?\]")
"""``[tools=K]`` or ``[tools=K:name]`` in a prompt: the simulated model calls a tool K times."""
TOOL_CALL = re.compile(r"<tool>([A-Za-z_]\w*): ([^<]*)</tool>")
"""A simulated tool call in a reply: ``<tool>calc: 2 + 3</tool>`` (name, argument)."""


def tool_turn(text: str) -> str | None:
    """The tool call the simulated model makes next for the input ``text``, or None (it answers).

    A prompt with ``[tools=K]`` (or ``[tools=K:name]``, default name ``calc``) gets a tool call
    in each of its first K replies: ``<tool>name: EXPR</tool>`` with the last arithmetic
    expression of the input; the replies after K closed calls in the input answer as usual."""
    marker = TOOL_MARKER.search(text)
    if marker is None or text.count("</tool>") >= int(marker.group(1)):
        return None
    found = _last_expression(text)
    return f" <tool>{marker.group(2) or 'calc'}: {found[0] if found else '1 + 1'}</tool>"


def _format_number(value: int | float) -> str:
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return str(value)


def _answer(text: str, accuracy: float, rng: random.Random) -> str:
    correct = evaluate_last_expression(text)
    if correct is None:
        return str(rng.randint(0, 1000))
    if rng.random() < accuracy:
        return _format_number(correct)
    offset = rng.choice([i for i in range(-10, 11) if i != 0])
    wrong = correct + offset
    return _format_number(round(wrong, 2) if isinstance(wrong, float) else wrong)


def _filler(length: int, rng: random.Random) -> str:
    text = ""
    while len(text) < length:
        text = f"{text} {rng.choice(_FILLER_WORDS)}" if text else rng.choice(_FILLER_WORDS)
    return text[:length]


@dataclass(frozen=True)
class _Plan:
    """What a request would generate if nothing stopped it."""

    response_ids: list[int]
    logprobs: list[float]


REPLY_MARKER = re.compile(r"\[reply=(\d+)\]")
"""A prompt's own reply length: ``[reply=N]`` (the bias benchmark's long and short prompts)."""


def reply_length(text: str) -> int | None:
    """The tokens still to generate for an input holding ``[reply=N]`` (the last one): ``N``
    minus the tokens after it (a continuation's partial response); None without one."""
    found = list(REPLY_MARKER.finditer(text))
    if not found:
        return None
    last = found[-1]
    return max(0, int(last.group(1)) - len(tokenize(text[last.end():])))


def _plan_response(config: SimConfig, text: str, rng: random.Random) -> _Plan:
    answer_part = tool_turn(text) or f" The answer is \\boxed{{{_answer(text, config.accuracy, rng)}}}."
    own = reply_length(text) if "[reply=" in text else None
    if own is not None:
        drawn = own
    elif config.length_sigma > 0:
        mu = math.log(config.mean_tokens) - config.length_sigma**2 / 2
        drawn = round(rng.lognormvariate(mu, config.length_sigma))
    else:
        drawn = config.mean_tokens
    total = max(len(answer_part), min(drawn, config.max_tokens_cap))
    ids = tokenize(_filler(total - len(answer_part), rng) + answer_part)
    logprobs = [-round(0.001 + 2.0 * rng.random() ** 3, 4) for _ in ids]
    return _Plan(ids, logprobs)
