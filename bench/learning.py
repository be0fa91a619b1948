"""Time to the same eval reward: sync vs one-off vs async on the real learning run (issue 30).

``python -m bench learning`` (any venv: the runs use the vLLM venv's interpreter, built by
``scripts/vllm-env``), or ``python -m bench.learning [--seeds 0 1 2] [--steps 100] [--target 0.3]``.

Each run is ``examples/tiny_grpo.py --schedule MODE --seed S`` (its own vLLM, Redis, producers),
one after the other, the engine side and the trainer pinned to separate cores, the same model,
data, seed, batch and learning rate in every mode. Per run the example records each step's
``wall_s``, generation wait G and training time T, and the eval reward every K steps
(evaluated after the run, so it costs no mode any time). Reported per mode, median and range over
the seeds: time and steps to the target eval reward, s/step, the speed-up over sync of the same
seed (time to target, and s/step), the bound (sync's G + T over max(G, T)) and the fraction of
it reached. Then async with the off-policy correction off (none), truncated (tis) and masked
(mis). A run that does not reach the target says so, with the best eval it got. Plot:
docs/img/learning_speed.png (eval reward vs training wall time).

``python -m bench.learning --rules`` runs instead async (TIS) under the staleness rule
``newest_token`` (the default) and ``oldest_token`` (the strict one) with partial rollout, and
``newest_token`` without it (issue 38): time to target, tokens generated per token trained,
token lags and recycles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.testing.learning import Bound, median_and_range
from rollstream.testing.vllm_server import vllm_python

from bench.common import IMG, OUT, ROOT, Table

MODES = ("sync", "one-off", "async")
STEPS = 100
TARGET = 0.55
SEEDS = (0, 1, 2)
EVAL_EVERY = 2
RUN_TIMEOUT = 1800.0
"""Seconds one run may take (set-up ~35 s, 100 steps ~50 s on a quiet 2-core machine)."""


@dataclass
class Run:
    mode: str
    seed: int
    correction: str
    summary: dict[str, Any] = field(default_factory=dict)
    eval: list[dict[str, float]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    rule: str = "newest_token"
    partial: bool = True


def run_one(python: str, mode: str, seed: int, correction: str, steps: int, target: float, out: Path,
            extra: list[str]) -> Run:
    """One example run; a failed run comes back with its error, it does not stop the others."""
    out.mkdir(parents=True, exist_ok=True)
    command = [python, str(ROOT / "examples" / "tiny_grpo.py"), "--schedule", mode, "--seed", str(seed),
               "--correction", correction, "--steps", str(steps), "--target", str(target),
               "--eval-every", str(EVAL_EVERY), "--out", str(out), "--no-plot", *extra]
    run = Run(mode, seed, correction)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    except subprocess.TimeoutExpired:
        run.error = f"did not finish within {RUN_TIMEOUT:.0f} s"
        return run
    (out / "output.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        run.error = f"exit {done.returncode}: {(done.stdout + done.stderr)[-400:]}"
        return run
    data = json.loads((out / "steps.json").read_text())
    run.summary, run.eval, run.rows = data["summary"], data["eval"], data["rows"]
    return run


def _cell(values: list[float], fmt: str = "{:.1f}") -> str:
    median, low, high = median_and_range(values)
    if math.isnan(median):
        return "-"
    return fmt.format(median) if low == high else f"{fmt.format(median)} ({fmt.format(low)}-{fmt.format(high)})"


def _ratio_at(run: Run, level: int, key: str) -> float:
    values = [r["ratio"][str(level)][key] for r in run.rows if str(level) in r["ratio"]]
    return statistics.median(values) if values else math.nan


def tables(runs: list[Run], target: float, steps: int, load: str) -> list[Table]:
    ok = [r for r in runs if not r.error]
    by = {(r.mode, r.seed, r.correction): r for r in ok}
    seeds = sorted({r.seed for r in runs})
    rows = []
    for mode in MODES:
        mine = [r for r in ok if r.mode == mode and r.correction == "tis"]
        if not mine:
            continue
        speedups, throughput, fractions, bounds = [], [], [], []
        for r in mine:
            sync = by.get(("sync", r.seed, "tis"))
            if sync is None:
                continue
            bound = Bound(sync.summary["generate_s_median"], sync.summary["train_s_median"])
            bounds.append(bound.speedup)
            throughput.append(sync.summary["s_per_step"] / r.summary["s_per_step"])
            if r.summary["reached"] and sync.summary["reached"] and r.summary["time_to_target_s"] > 0:
                speedup = sync.summary["time_to_target_s"] / r.summary["time_to_target_s"]
                speedups.append(speedup)
                fractions.append(bound.fraction(speedup))
        reached = [r for r in mine if r.summary["reached"]]
        rows.append([
            mode, f"{len(reached)}/{len(mine)}",
            _cell([r.summary["time_to_target_s"] for r in reached]),
            _cell([float(r.summary["steps_to_target"]) for r in reached], "{:.0f}"),
            _cell([r.summary["s_per_step"] for r in mine], "{:.3f}"),
            _cell([r.summary["generate_s_median"] for r in mine], "{:.3f}"),
            _cell([r.summary["train_s_median"] for r in mine], "{:.3f}"),
            "-" if mode == "sync" else _cell(bounds, "{:.2f}"),
            "-" if mode == "sync" else _cell(speedups, "{:.2f}"),
            "-" if mode == "sync" else _cell(fractions, "{:.2f}"),
            "-" if mode == "sync" else _cell(throughput, "{:.2f}"),
            _cell([r.summary["best_eval"] for r in mine], "{:.3f}"),
            _cell([statistics.fmean(x["staleness_mean"] for x in r.rows) if r.rows else math.nan for r in mine],
                  "{:.2f}"),
            _cell([statistics.fmean(x["recycled_aborted"] for x in r.rows) if r.rows else math.nan for r in mine],
                  "{:.1f}"),
        ])
    by_correction = []
    for correction in ("none", "tis", "mis"):
        mine = [r for r in ok if r.mode == "async" and r.correction == correction]
        if not mine:
            continue
        reached = [r for r in mine if r.summary["reached"]]
        by_correction.append([
            correction, f"{len(reached)}/{len(mine)}",
            _cell([r.summary["time_to_target_s"] for r in reached]),
            _cell([float(r.summary["steps_to_target"]) for r in reached], "{:.0f}"),
            _cell([r.summary["best_eval"] for r in mine], "{:.3f}"),
            _cell([r.eval[-1]["reward"] for r in mine if r.eval], "{:.3f}"),
            _cell([_ratio_at(r, 1, "p99") for r in mine], "{:.3f}"),
            _cell([_ratio_at(r, 2, "p99") for r in mine], "{:.3f}"),
            _cell([_ratio_at(r, 2, "p1") for r in mine], "{:.3f}"),
        ])
    per_run = []
    for r in runs:
        s = r.summary
        if r.error:
            per_run.append([r.mode, r.seed, r.correction, f"failed: {r.error[:80]}", *["-"] * 8])
            continue
        per_run.append([
            r.mode, r.seed, r.correction,
            f"step {s['steps_to_target']}, {s['time_to_target_s']:.1f} s" if s["reached"]
            else f"not reached ({s['stopped']}): best {s['best_eval']:.3f} at step {s['best_eval_step']:.0f}",
            s["steps"], s["s_per_step"], s["generate_s_median"], s["train_s_median"], s["ratio_s0_max_dev"],
            _ratio_at(r, 1, "mean"), _ratio_at(r, 1, "p99"), _ratio_at(r, 2, "p99"),
        ])
    notes = [
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}) per mode, up to {steps} steps of 32 groups x 8 "
        f"samples; target: eval reward >= {target} (the exact expected reward over every (A, B) pair, of the "
        f"weights snapshotted every {EVAL_EVERY} steps, scored after the run); median (min-max) over the seeds; "
        f"{load}.",
        "Clock: from the first batch taken (the pipeline's start, ~10 s, is the same in every mode). The async "
        "modes then hold up to max_staleness batches generated during that start: at most ~2 batches of G "
        "(~0.5 s) over a run.",
        "G: the trainer's wait in take(); T: train step + save + WeightSync.update (median per step, first step "
        "excluded). bound = sync's (G + T) / max(G, T) of the same seed; speed-up = sync's time to target / the "
        "mode's (same seed); fraction = speed-up / bound; s/step speed-up = sync's s/step / the mode's.",
        "Cores: vLLM, the producer, Redis and the feeder on core 0, the trainer (one torch thread) on core 1; "
        "the machine is shared, so both cores also run other sessions' work.",
    ]
    result = [
        Table("learning", "Time to the same eval reward: sync vs one-off vs async (tiny GRPO on vLLM, CPU)",
              ["mode", "reached", "time to target s", "steps to target", "s/step", "G s", "T s", "bound",
               "speed-up (time to target)", "fraction of bound", "speed-up (s/step)", "best eval",
               "staleness (mean)", "groups aborted / step"], rows, notes, "python -m bench learning"),
        Table("learning_correction", "async (max_staleness 2): off-policy correction off, truncated (TIS), masked (MIS)",
              ["correction", "reached", "time to target s", "steps to target", "best eval", "last eval",
               "ratio p99 at staleness 1", "p99 at 2", "p1 at 2"], by_correction,
              ["Same runs' seeds; the ratio columns are medians over steps of each step's p1 / p99 (cap 2: TIS "
               "truncates above it, MIS drops those tokens)."], "python -m bench learning"),
        Table("learning_runs", "Every run: time to target, per-step G and T, importance ratio",
              ["mode", "seed", "correction", "target", "steps", "s/step", "G s", "T s",
               "ratio staleness 0: max |r-1|", "ratio staleness 1: mean", "p99 at 1", "p99 at 2"], per_run,
              ["ratio = exp(trainer - behaviour log-prob) per response token, median over steps of each step's "
               "mean / p99; at staleness 0 it must be 1 within float error (fp32 vLLM vs transformers ~1e-6)."],
              "python -m bench learning"),
    ]
    return result


RULES = (("newest_token", True), ("oldest_token", True), ("newest_token", False))
"""The staleness-rule runs (issue 38): async, TIS, the chosen rule and the strict one with partial
rollout, and the chosen rule without it."""


def _rule_dir(rule: str, partial: bool, seed: int) -> Path:
    return OUT / "learning" / f"rule-{rule}-{'partial' if partial else 'no-partial'}-s{seed}"


def _mean_of(run: Run, key: str) -> float:
    values = [float(r[key]) for r in run.rows if key in r]
    return statistics.fmean(values) if values else math.nan


def rule_table(runs: list[Run], target: float, steps: int, load: str) -> Table:
    rows = []
    for rule, partial in RULES:
        mine = [r for r in runs if not r.error and r.rule == rule and r.partial == partial]
        if not mine:
            continue
        reached = [r for r in mine if r.summary["reached"]]
        rows.append([
            f"{rule}, partial rollout {'on' if partial else 'off'}", f"{len(reached)}/{len(mine)}",
            _cell([r.summary["time_to_target_s"] for r in reached]),
            _cell([float(r.summary["steps_to_target"]) for r in reached], "{:.0f}"),
            _cell([r.summary["s_per_step"] for r in mine], "{:.3f}"),
            _cell([r.summary["best_eval"] for r in mine], "{:.3f}"),
            _cell([r.eval[-1]["reward"] for r in mine if r.eval], "{:.3f}"),
            _cell([r.summary.get("generated_per_trained") or math.nan for r in mine], "{:.3f}"),
            _cell([_mean_of(r, "token_lag_mean") for r in mine], "{:.2f}"),
            _cell([_mean_of(r, "recycled_stale") for r in mine], "{:.2f}"),
            _cell([_mean_of(r, "recycled_aborted") + _mean_of(r, "recycled_weight_update") for r in mine], "{:.2f}"),
        ])
    seeds = sorted({r.seed for r in runs})
    return Table(
        "learning_rule", "The staleness rule on the learning run: newest token (chosen) vs oldest token (strict)",
        ["config", "reached", "time to target s", "steps to target", "s/step", "best eval", "last eval",
         "tokens generated per token trained", "token lag (mean)", "groups recycled stale / step",
         "groups recycled aborted / step"], rows,
        [f"async (max_staleness 2), TIS, {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), up to {steps} steps; "
         f"target eval reward >= {target}; median (min-max) over the seeds; {load}.",
         "tokens generated per token trained: vLLM's vllm:generation_tokens_total at the end over the response "
         "tokens of the trained batches (what was in flight at the end counts as generated)."],
        "python -m bench.learning --rules")


def measure_rules(seeds: list[int], steps: int, target: float, extra: list[str]) -> list[Table]:
    python = vllm_python()
    if python is None:
        raise SystemExit("bench learning needs the vLLM venv: run scripts/vllm-env first")
    load = f"load average (1/5/15 min) at the start {_load()}"
    runs = []
    for seed in seeds:
        for rule, partial in RULES:
            flags = [*extra, "--staleness-rule", rule, "--partial-rollout" if partial else "--no-partial-rollout"]
            run = run_one(python, "async", seed, "tis", steps, target, _rule_dir(rule, partial, seed), flags)
            run.rule, run.partial = rule, partial
            print(f"  {rule} partial {partial} seed {seed}: "
                  + (run.error or f"{run.summary['steps']} steps, reached {run.summary['reached']}"), flush=True)
            runs.append(run)
    return [rule_table(runs, target, steps, load + f", at the end {_load()}")]


def report_rules(seeds: list[int], target: float) -> list[Table]:
    runs = []
    for seed in seeds:
        for rule, partial in RULES:
            path = _rule_dir(rule, partial, seed) / "steps.json"
            run = Run("async", seed, "tis", rule=rule, partial=partial)
            if path.exists():
                data = json.loads(path.read_text())
                run.summary, run.eval, run.rows = data["summary"], data["eval"], data["rows"]
            else:
                run.error = f"no {path}"
            runs.append(run)
    steps = max((r.summary.get("steps", 0) for r in runs), default=0)
    return [rule_table(runs, target, steps, "load not recorded")]


def plot(runs: list[Run], target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    colours = {"sync": "tab:blue", "one-off": "tab:orange", "async": "tab:green",
               "none": "tab:red", "tis": "tab:green", "mis": "tab:purple"}
    for ax, pick, key, title in (
        (axes[0], lambda r: r.correction == "tis", "mode", "sync vs one-off vs async (TIS)"),
        (axes[1], lambda r: r.mode == "async", "correction", "async: off-policy correction off / TIS / MIS"),
    ):
        labelled: set[str] = set()
        for r in runs:
            if r.error or not pick(r):
                continue
            name = getattr(r, key)
            ax.plot([p["wall_s"] for p in r.eval], [p["reward"] for p in r.eval], color=colours[name], alpha=0.8,
                    marker=".", ms=3, label=None if name in labelled else name)
            labelled.add(name)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("training wall time (s)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("eval reward (exact expected, every pair)")
    fig.suptitle("tiny GRPO through rollstream on a CPU vLLM: eval reward vs wall-clock (one line per seed)")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    path = IMG / "learning_speed.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plan(seeds: list[int], corrections: bool) -> list[tuple[str, int, str]]:
    plan = [(mode, seed, "tis") for seed in seeds for mode in MODES]
    if corrections:
        plan += [("async", seed, c) for seed in seeds for c in ("none", "mis")]
    return plan


def _load() -> str:
    return " / ".join(f"{v:.1f}" for v in os.getloadavg())


def measure(seeds: list[int], steps: int, target: float, corrections: bool, extra: list[str]) -> list[Table]:
    python = vllm_python()
    if python is None:
        raise SystemExit("bench learning needs the vLLM venv: run scripts/vllm-env first")
    load = f"load average (1/5/15 min) at the start {_load()}"
    runs = []
    for mode, seed, correction in _plan(seeds, corrections):
        run = run_one(python, mode, seed, correction, steps, target, OUT / "learning" / f"{mode}-{correction}-s{seed}",
                      extra)
        print(f"  {mode} seed {seed} {correction}: "
              + (run.error or f"{run.summary['steps']} steps, reached {run.summary['reached']}"), flush=True)
        runs.append(run)
    (OUT / "learning" / "load.txt").write_text(load + f", at the end {_load()}")
    plot(runs, target)
    return tables(runs, target, steps, load + f", at the end {_load()}")


def report(seeds: list[int], target: float, corrections: bool) -> list[Table]:
    """The tables and the plot again from the runs' steps.json in bench/out/learning (no rerun)."""
    runs = []
    for mode, seed, correction in _plan(seeds, corrections):
        path = OUT / "learning" / f"{mode}-{correction}-s{seed}" / "steps.json"
        run = Run(mode, seed, correction)
        if path.exists():
            data = json.loads(path.read_text())
            run.summary, run.eval, run.rows = data["summary"], data["eval"], data["rows"]
        else:
            run.error = f"no {path}"
        runs.append(run)
    steps = max((r.summary.get("steps", 0) for r in runs), default=0)
    load_file = OUT / "learning" / "load.txt"
    plot(runs, target)
    return tables(runs, target, steps, load_file.read_text() if load_file.exists() else "load not recorded")


def run(quick: bool = False) -> list[Table]:
    if quick:
        return measure([0], 6, TARGET, corrections=False, extra=[])
    return measure(list(SEEDS), STEPS, TARGET, corrections=True, extra=[])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--target", type=float, default=TARGET)
    p.add_argument("--no-corrections", action="store_true", help="skip the async correction none / mis runs")
    p.add_argument("--report", action="store_true", help="only rebuild the tables and the plot from bench/out/learning")
    p.add_argument("--rules", action="store_true",
                   help="instead: async with the staleness rule newest_token vs oldest_token (and without partial rollout)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags for every examples/tiny_grpo.py run")
    args = p.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.rules:
        produced = (report_rules(args.seeds, args.target) if args.report
                    else measure_rules(args.seeds, args.steps, args.target, extra))
    elif args.report:
        produced = report(args.seeds, args.target, not args.no_corrections)
    else:
        produced = measure(args.seeds, args.steps, args.target, not args.no_corrections, extra)
    for table in produced:
        text = table.markdown()
        print(text, flush=True)
        (OUT / f"{table.name}.md").write_text(text)
    print(f"plot: {IMG / 'learning_speed.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
