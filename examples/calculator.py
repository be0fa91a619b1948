"""A calculator-tool rollout: the model asks ``<tool>calc: 2 + 3</tool>``, the tool answers.

Run it on the CPU against the engine simulator (whose prompts with ``[tools=K]`` make K tool
calls, then answer)::

    rollstream demo --generate examples/calculator.py:generate

or on a producer: ``rollstream produce ... --generate examples/calculator.py:generate``. The
model's tokens are trained on (loss mask 1), the ``<result>...</result>`` tokens are not (0).
"""

from __future__ import annotations

import ast
import operator
import re

from rollstream import Episode, Sample

TOOL_CALL = re.compile(r"<tool>calc: ([^<]*)</tool>")
MAX_TURNS = 8
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of ``+ - * /`` arithmetic, without ``eval``; an error message otherwise."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("unsupported expression")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.4g}"


async def generate(episode: Episode) -> Sample:
    """Generate; while the reply ends in a tool call, append the tool's result and continue."""
    for _ in range(MAX_TURNS):
        turn = await episode.generate()
        calls = TOOL_CALL.findall(turn.text)
        if not calls or turn.truncated or episode.room == 0:
            break
        await episode.observe(f"<result>{calculate(calls[-1])}</result>")
    return episode.sample
