"""Generate ``arithmetic.jsonl``: the demo dataset of short arithmetic word problems.

Every line is ``{"prompt": "...", "label": "<integer answer>"}``. Each prompt is a short word
problem that ends with an explicit expression, ``... Compute 8 * 12 - 5 and put the final answer
in \\boxed{}.``, so that the engine simulator can solve it: the expression is the last arithmetic
expression of the prompt and nothing after it contains a digit. Answers (and every intermediate
result) are non-negative integers; divisions are exact.

Deterministic for a given seed::

    python cli/data/make_arithmetic.py            # rewrites cli/data/arithmetic.jsonl
    python cli/data/make_arithmetic.py --n 50 --seed 1 --out /tmp/small.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

NAMES = [
    "Lena", "Omar", "Priya", "Tom", "Aiko", "Mateo", "Sara", "Jonas", "Fatima", "Leo",
    "Nina", "Ravi", "Chloe", "Ibrahim", "Mia", "Hugo", "Zara", "Felix", "Amara", "Kenji",
]  # fmt: skip
ITEMS = ["notebooks", "pens", "apples", "mugs", "tickets", "candles", "plants", "books"]
SUFFIX = " Compute {expr} and put the final answer in \\boxed{{}}."

Problem = tuple[str, str]  # (story text, expression)


def _shopping(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 15)
    bill = next(b for b in (20, 50, 100, 200) if b >= count * price)
    return (
        f"{name} buys {count} {item} at {price} dollars each and pays with a {bill} dollar note. "
        "How much change does the cashier give back?",
        f"{bill} - {count} * {price}",
    )


def _travel(rng: random.Random) -> Problem:
    speed, hours, extra = rng.randint(30, 120), rng.randint(2, 6), rng.randint(5, 60)
    vehicle = rng.choice(["train", "bus", "car", "ferry"])
    return (
        f"A {vehicle} travels at {speed} kilometres per hour for {hours} hours and then covers "
        f"{extra} more kilometres. How far does it travel in total?",
        f"{speed} * {hours} + {extra}",
    )


def _sharing(rng: random.Random) -> Problem:
    name, friends, each = rng.choice(NAMES), rng.randint(2, 9), rng.randint(3, 25)
    thing = rng.choice(["stickers", "marbles", "cookies", "cards"])
    return (
        f"{name} has {friends * each} {thing} and shares them equally among {friends} friends. "
        f"How many {thing} does each friend get?",
        f"{friends * each} / {friends}",
    )


def _ages(rng: random.Random) -> Problem:
    name, age = rng.choice(NAMES), rng.randint(4, 15)
    times, years = rng.randint(2, 4), rng.randint(1, 12)
    relative = rng.choice(["mother", "father", "aunt", "uncle"])
    return (
        f"{name} is {age} years old and {name}'s {relative} is {times} times as old. "
        f"How old will the {relative} be in {years} years?",
        f"{times} * {age} + {years}",
    )


def _saving(rng: random.Random) -> Problem:
    name, weekly, weeks = rng.choice(NAMES), rng.randint(5, 40), rng.randint(3, 12)
    spent = rng.randint(1, weekly * weeks)
    gift = rng.choice(["a gift", "a bicycle bell", "a board game", "concert tickets"])
    return (
        f"{name} saves {weekly} dollars every week for {weeks} weeks and then spends {spent} "
        f"dollars on {gift}. How much money is left?",
        f"{weekly} * {weeks} - {spent}",
    )


def _packing(rng: random.Random) -> Problem:
    name, boxes, per_box = rng.choice(NAMES), rng.randint(2, 12), rng.randint(6, 24)
    given = rng.randint(1, boxes * per_box)
    return (
        f"{name} packs {boxes} boxes with {per_box} pencils each and gives {given} pencils away. "
        "How many pencils are left?",
        f"{boxes} * {per_box} - {given}",
    )


def _baking(rng: random.Random) -> Problem:
    bag = rng.randint(2, 8)
    trays = rng.randint(2, 9)
    per_tray = bag * rng.randint(2, 6)
    return (
        f"A bakery bakes {trays} trays of {per_tray} cookies and packs the cookies into bags of "
        f"{bag}. How many bags does it fill?",
        f"({trays} * {per_tray}) / {bag}",
    )


def _garden(rng: random.Random) -> Problem:
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    died, planted = rng.randint(1, rows * per_row), rng.randint(1, 30)
    return (
        f"A garden has {rows} rows of {per_row} tomato plants. {died} plants wither and the "
        f"gardener plants {planted} new ones. How many plants are in the garden now?",
        f"{rows} * {per_row} - {died} + {planted}",
    )


def _reading(rng: random.Random) -> Problem:
    name, per_day, days = rng.choice(NAMES), rng.randint(5, 30), rng.randint(2, 10)
    pages = per_day * days + rng.randint(0, 200)
    return (
        f"A novel has {pages} pages. {name} reads {per_day} pages a day for {days} days. "
        "How many pages are still unread?",
        f"{pages} - {per_day} * {days}",
    )


def _teams(rng: random.Random) -> Problem:
    teams, size = rng.randint(2, 6), rng.randint(3, 9)
    boys = rng.randint(1, teams * size - 1)
    girls = teams * size - boys
    return (
        f"A class has {boys} boys and {girls} girls. The teacher splits the whole class into "
        f"{teams} teams of equal size. How many students are in each team?",
        f"({boys} + {girls}) / {teams}",
    )


def _bus(rng: random.Random) -> Problem:
    start = rng.randint(10, 60)
    off1 = rng.randint(0, start)
    on1 = rng.randint(0, 25)
    off2 = rng.randint(0, start - off1 + on1)
    return (
        f"A bus leaves the depot with {start} passengers. At the first stop {off1} get off and "
        f"{on1} get on. At the second stop {off2} get off. How many passengers are on the bus?",
        f"{start} - {off1} + {on1} - {off2}",
    )


def _orchard(rng: random.Random) -> Problem:
    name, baskets = rng.choice(NAMES), rng.randint(2, 8)
    days = rng.randint(2, 7)
    per_day = rng.randint(2, 12) * baskets
    return (
        f"{name} picks {per_day} apples a day for {days} days and splits all of them equally "
        f"into {baskets} baskets. How many apples go into each basket?",
        f"({per_day} * {days}) / {baskets}",
    )


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    _shopping, _travel, _sharing, _ages, _saving, _packing,
    _baking, _garden, _reading, _teams, _bus, _orchard,
]  # fmt: skip

_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}
LAST_EXPRESSION = re.compile(r"[\d(][\d\s+\-*/()]*[\d)]")


def evaluate(expr: str) -> int:
    """Evaluate ``expr`` exactly; every intermediate result must be a non-negative integer."""

    def walk(node: ast.expr) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ValueError(f"division by zero in {expr!r}")
                value = left / right
            elif type(node.op) in _OPS:
                value = _OPS[type(node.op)](left, right)
            else:
                raise ValueError(f"unsupported operator in {expr!r}")
            if value.denominator != 1 or value < 0:
                raise ValueError(f"{expr!r} has a non-integer or negative step: {value}")
            return value
        raise ValueError(f"unsupported syntax in {expr!r}")

    return int(walk(ast.parse(expr, mode="eval").body))


def make_problem(rng: random.Random, template: Callable[[random.Random], Problem]) -> dict[str, str]:
    story, expr = template(rng)
    prompt = story + SUFFIX.format(expr=expr)
    answer = evaluate(expr)
    # self-checks: the expression is the last one in the prompt, and the tail has no digit
    last = LAST_EXPRESSION.findall(prompt)[-1].strip()
    if last != expr:
        raise AssertionError(f"last expression {last!r} != {expr!r} in {prompt!r}")
    if re.search(r"\d", prompt[prompt.rindex(expr) + len(expr) :]):
        raise AssertionError(f"digits after the expression in {prompt!r}")
    return {"prompt": prompt, "label": str(answer)}


def generate(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    problems: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(problems) < n:
        template = TEMPLATES[len(problems) % len(TEMPLATES)]
        problem = make_problem(rng, template)
        if problem["prompt"] not in seen:
            seen.add(problem["prompt"])
            problems.append(problem)
    rng.shuffle(problems)
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("arithmetic.jsonl"))
    args = parser.parse_args()
    problems = generate(args.n, args.seed)
    with args.out.open("w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps(problem) + "\n")
    print(f"wrote {len(problems)} problems to {args.out}")


if __name__ == "__main__":
    main()
