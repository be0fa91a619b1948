"""Async vs sync on the real learning run: examples/tiny_grpo.py at max_staleness 0, 1, 2.

``.venv-vllm/bin/python -m bench.learning_staleness [--steps 40] [--target 0.45]``

Same task, seed and hyper-parameters; one run per setting, one after the other (each starts its
own vLLM). Reported: training wall time (from the first step's batch to the last, so the set-up
is not counted), the time and step at which the 5-step moving mean reward first reaches
``--target``, the reward of the last 10 steps, mean staleness and the log-prob gap. A plot of
reward vs training wall time goes to docs/img/learning_staleness.png.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(staleness: int, steps: int, out: Path) -> list[dict[str, float]]:
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--steps", str(steps), "--max-staleness",
         str(staleness), "--out", str(out), "--no-plot"],
        check=True, stdout=subprocess.DEVNULL,
    )
    rows: list[dict[str, float]] = json.loads((out / "steps.json").read_text())["rows"]
    return rows


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop vLLM and the children on SIGTERM too
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--target", type=float, default=0.45)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args()
    runs: dict[int, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-staleness-") as tmp:
        for s in args.staleness:
            runs[s] = _run(s, args.steps, Path(tmp) / f"s{s}")
    print(f"| max_staleness | training wall s ({args.steps} steps) | s/step | reaches {args.target} (5-step mean) at "
          "| reward, last 10 | staleness mean | gap mean (median step) |")
    print("|---|---|---|---|---|---|---|")
    for s, rows in runs.items():
        t0 = rows[0]["wall_s"]
        wall = rows[-1]["wall_s"] - t0
        reached = "-"
        for i in range(4, len(rows)):
            if sum(r["reward_mean"] for r in rows[i - 4 : i + 1]) / 5 >= args.target:
                reached = f"step {i}, {rows[i]['wall_s'] - t0:.0f} s"
                break
        last = sum(r["reward_mean"] for r in rows[-10:]) / 10
        stale = sum(r["staleness_mean"] for r in rows) / len(rows)
        gaps = sorted(r["logprob_gap_mean"] for r in rows[1:] if not math.isnan(r["logprob_gap_mean"]))
        print(f"| {s} | {wall:.0f} | {wall / (len(rows) - 1):.2f} | {reached} | {last:.3f} | {stale:.2f} | "
              f"{gaps[len(gaps) // 2]:.1e} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, rows in runs.items():
        ax.plot([r["wall_s"] - rows[0]["wall_s"] for r in rows], [r["reward_mean"] for r in rows], marker=".",
                label=f"max_staleness {s}")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("mean reward")
    ax.set_title("tiny GRPO on vLLM (CPU): async vs sync")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "img" / "learning_staleness.png", dpi=100)


if __name__ == "__main__":
    main()
