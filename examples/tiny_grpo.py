"""A real learning run through rollstream on a CPU: a tiny Llama learns addition with GRPO.

One command (``rollstream demo --real [FLAGS]`` or ``./scripts/demo --real``: they build the vLLM venv
on first use; or ``.venv-vllm/bin/python examples/tiny_grpo.py``):
build the tiny model (rollstream.testing.tiny_model), warm it up with a short SFT in torch,
start vLLM on it, an embedded Redis, the feeder and the producers (``--engine-api vllm``), then
train with GRPO: take a batch, recompute the samples' log-probs with the trainer's weights (the
rollout-vs-trainer log-prob gap), one policy-gradient step with the off-policy correction
(``--correction tis|mis|none``), save the weights and move vLLM and rollstream to the new
version with :class:`rollstream.weight_sync.WeightSync`. A live table per step; ``steps.json`` and
``learning.png`` in ``--out``.

``--schedule sync|one-off|async`` (issue 30; docs/benchmarks.md): sync generates a batch on the
current weights, then trains (max_staleness 0: admission lets the next batch in only once the
new version is set); one-off overlaps one step (max_staleness 1); async two or more with partial
rollout. The engine side (vLLM, producers, Redis, feeder) and the trainer run pinned to separate
cores (``--engine-cpus`` / ``--trainer-cpus``), as they would run on separate GPUs. Every
``--eval-every`` steps the weights are snapshotted and, after the run (off the training path:
the evaluation costs neither side any time), scored with the exact expected reward on every
(A, B) pair, none of them a training batch (``--heldout N`` evaluates N pairs the SFT and the RL
data never contain instead: RL on the others memorises, and their reward falls);
``steps.json`` gives the time and step at which the eval reward first reaches ``--target``, or
how far the run got.

Reading the log-prob gap (``|rollout - trainer|`` per response token, mean and max per step):
a sample generated on the weights the trainer holds (staleness 0) agrees to ~1e-5 in fp32; a
stale sample differs by what one optimizer step moved (here ~1e-2 .. 1e-1, larger with a larger
learning rate); a token misaligned between prompt and response (or a wrong version label) is
off by whole nats (> 1). The importance ratio (its mean, p1 and p99 per staleness level are in
``steps.json``) corrects the stale ones and must be 1 at staleness 0; the last kind is a bug.
Staleness here is per token: ``Batch.token_lags_numpy()`` gives each response token's version
lag beside its behaviour log-prob (a sample continued across weight updates spans several), the
ratio is reported per lag, and ``--max-token-lag K`` masks the tokens older than K versions out
of the loss (``tokens_masked_by_lag`` per step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rollstream import ConfigError, GroupConsumer, WeightSync
from rollstream.runtime.children import start_cli, stop_processes
from rollstream.runtime.redis_server import EmbeddedRedis, free_port
from rollstream.testing.learning import (
    CORRECTIONS,
    SCHEDULES,
    STALENESS_ZERO_TOLERANCE,
    Bound,
    check_correction,
    first_reaching,
    importance_weights,
    mask_by_lag,
    quantile,
    ratio_stats,
    resolve_schedule,
)
from rollstream.testing.tiny_model import build_model, save_weights
from rollstream.testing.vllm_server import vllm_server

logger = logging.getLogger("tiny_grpo")

COLUMNS = (
    ("step", "step", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("G s", "generate_s", "{:.2f}"),
    ("T s", "train_s", "{:.2f}"),
    ("stale", "staleness_mean", "{:.2f}"),
    ("gap mean", "logprob_gap_mean", "{:.1e}"),
    ("gap on-pol max", "logprob_gap_onpolicy_max", "{:.1e}"),
    ("r p99", "ratio_p99", "{:.3f}"),
    ("recyc abort", "recycled_aborted", "{:.0f}"),
    ("recyc stale", "recycled_stale", "{:.0f}"),
    ("sync s", "sync_s", "{:.2f}"),
)
Snapshots = dict[int, tuple[float, dict[str, Any]]]
"""The eval's weight snapshots: ``{version: (wall_s, state_dict)}``."""
HELDOUT_SEED = 7
"""The held-out pairs are the same for every ``--seed``, so the seeds' eval rewards compare."""


def parse_cpus(text: str) -> set[int]:
    """``"0"``, ``"0-3"``, ``"0,2"`` -> a set of CPU ids."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def split_cpus(engine: str | None, trainer: str | None) -> tuple[set[int], set[int]] | None:
    """The engine side's and the trainer's cores: given, else the first half of the allowed CPUs
    and the rest; None (no pinning) with ``all`` or on a single CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    if engine == "all" or trainer == "all" or (engine is None and trainer is None and len(allowed) < 2):
        return None
    half = max(1, len(allowed) // 2)
    engine_cpus = parse_cpus(engine) if engine else set(allowed[:half])
    trainer_cpus = parse_cpus(trainer) if trainer else (set(allowed) - engine_cpus or set(allowed[half:]))
    if engine_cpus & trainer_cpus:
        raise ConfigError(f"--engine-cpus {sorted(engine_cpus)} and --trainer-cpus {sorted(trainer_cpus)} overlap")
    unknown = (engine_cpus | trainer_cpus) - set(allowed)
    if unknown:
        raise ConfigError(f"CPUs {sorted(unknown)} are not available to this process (allowed: {allowed})")
    return engine_cpus, trainer_cpus


def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process (``sched_setaffinity(0)`` moves only the calling one, and
    torch's pool threads exist since the SFT); children started later inherit the mask."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="at most this many steps")
    p.add_argument("--budget-s", type=float, default=None, help="and at most this many seconds of training")
    p.add_argument("--batch-size", type=int, default=32, help="groups per step")
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="sync (max_staleness 0), one-off (1), async (>= 2, partial rollout); default from "
                        "--max-staleness")
    p.add_argument("--max-staleness", type=int, default=None, help="default: 1, or what --schedule means")
    p.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="aborted samples continue (default: on with --schedule async)")
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64, help="samples in flight per producer")
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--heldout", type=int, default=0, help="(A, B) pairs kept out of SFT and RL and evaluated "
                   "instead of every pair (docs/benchmarks.md: RL on the rest memorises, their reward falls)")
    p.add_argument("--sft-steps", type=int, default=70)
    p.add_argument("--sft-seed", type=int, default=1, help="the warm-up's data order: kept apart from --seed so "
                   "every seed's RL starts from the same model (the eval after the SFT is 0.17-0.37 across these)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=5, help="linear lr warm-up")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--correction", choices=CORRECTIONS, default="tis",
                   help="off-policy correction from the behaviour log-probs: truncated (tis) or masked (mis) "
                        "importance sampling, or none")
    p.add_argument("--is-cap", type=float, default=2.0, help="the ratio's truncation / mask threshold")
    p.add_argument("--max-token-lag", type=int, default=None,
                   help="mask out of the loss the tokens generated more than K versions before the trainer's "
                        "(Batch.token_lags_numpy: MIS by lag); default: keep every token")
    p.add_argument("--staleness-rule", choices=["newest_token", "oldest_token"], default="newest_token",
                   help="the namespace's staleness rule (docs/staleness.md)")
    p.add_argument("--mode", default="abort", choices=["abort", "wait", "keep"], help="engine pause mode")
    p.add_argument("--engine-cpus", default=None, help="cores of vLLM, the producers, Redis, the feeder "
                   "(e.g. 0 or 0-1; default: the first half of the allowed CPUs; 'all': no pinning)")
    p.add_argument("--trainer-cpus", default=None, help="cores of the trainer (default: the other CPUs)")
    p.add_argument("--eval-every", type=int, default=2, help="snapshot the weights for the eval every K steps")
    p.add_argument("--target", type=float, default=0.55, help="the eval reward whose first reach is reported")
    p.add_argument("--take-timeout", type=float, default=300.0, help="a take() waiting longer ends the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the trainer (default: its cores)")
    p.add_argument("--out", default=None, help="directory for steps.json and learning.png")
    p.add_argument("--workdir", default=None, help="keep the model, weights and logs here")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        schedule = resolve_schedule(args.schedule, args.max_staleness, args.partial_rollout)
        check_correction(args.correction, args.is_cap)
        if args.eval_every < 1 or args.steps < 1 or args.heldout < 0:
            raise ConfigError("--steps and --eval-every must be at least 1, --heldout at least 0")
        if args.heldout >= (args.max_operand + 1) ** 2:
            raise ConfigError(f"--heldout {args.heldout} leaves no (A, B) pair to train on")
        args.cpus = split_cpus(args.engine_cpus, args.trainer_cpus)
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    args.schedule, args.max_staleness = schedule.name, schedule.max_staleness
    args.partial_rollout = schedule.partial_rollout
    return args


# -- the task -------------------------------------------------------------------------------


def split_pairs(max_operand: int, heldout: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pairs, held-out pairs) of ``A+B`` with ``0 <= A, B <= max_operand``."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    held = set(random.Random(HELDOUT_SEED).sample(pairs, heldout))
    return [pair for pair in pairs if pair not in held], sorted(held)


def task_records(pairs: list[tuple[int, int]], count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in (rng.choice(pairs) for _ in range(count))]


# -- the model side -------------------------------------------------------------------------


def sft_warmup(model: Any, tokenizer: Any, args: argparse.Namespace, pairs: list[tuple[int, int]]) -> float:
    """A short supervised warm-up on ``A+B=C<eos>``: the model learns the format and some sums."""
    rng = random.Random(args.sft_seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr)
    model.train()
    loss_value = math.nan
    for _ in range(args.sft_steps):
        rows = []
        for _ in range(64):
            a, b = rng.choice(pairs)
            prompt = tokenizer.encode(f"{a}+{b}=")
            answer = [*tokenizer.encode(str(a + b), add_special_tokens=False), tokenizer.eos_token_id]
            rows.append((prompt + answer, len(prompt)))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (seq, prompt_len) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
            mask[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
    return loss_value


def _forward_logprobs(model: Any, rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Per position ``i``: log p(token i+1 | tokens ..i) for each row (padded)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def response_logprobs(model: Any, samples: list[Any], pad_id: int) -> list[torch.Tensor]:
    """Log-probs of each sample's response tokens under ``model`` (with grad if enabled)."""
    logp = _forward_logprobs(model, [list(s.tokens) for s in samples], pad_id)
    out = []
    for i, s in enumerate(samples):
        start = s.prompt_length - 1
        out.append(logp[i, start : start + s.response_length])
    return out


def answer_spellings(tokenizer: Any, text: str) -> list[list[int]]:
    """Every token sequence that decodes to ``text`` (``"12"``: one token, or ``"1"`` + ``"2"``)."""
    vocab = tokenizer.get_vocab()
    if not text:
        return [[]]
    out = []
    for cut in range(1, len(text) + 1):
        head = tokenizer.convert_tokens_to_ids(text[:cut]) if text[:cut] in vocab else None
        if head is not None:
            out += [[head, *rest] for rest in answer_spellings(tokenizer, text[cut:])]
    return out


@torch.no_grad()
def expected_reward(model: Any, tokenizer: Any, pairs: list[tuple[int, int]]) -> float:
    """The eval reward: the exact probability that a sample (temperature 1, as the producers
    sample) is the sum followed by ``<eos>``, whichever tokens spell it, averaged over ``pairs``.
    Exact, so the eval has no sampling noise of its own."""
    model.eval()
    rows, owners, starts = [], [], []
    for k, (a, b) in enumerate(pairs):
        prompt = tokenizer.encode(f"{a}+{b}=")
        for spelling in answer_spellings(tokenizer, str(a + b)):
            rows.append(prompt + spelling + [tokenizer.eos_token_id])
            owners.append(k)
            starts.append(len(prompt))
    logp = _forward_logprobs(model, rows, tokenizer.pad_token_id)
    per_pair = [0.0] * len(pairs)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        per_pair[owners[i]] += math.exp(float(logp[i, start - 1 : len(row) - 1].sum()))
    return sum(per_pair) / len(pairs)


def grpo_step(model: Any, optimizer: Any, batch: Any, pad_id: int, args: argparse.Namespace) -> dict[str, Any]:
    """One policy-gradient step over the batch (group-normalised advantages), each token's term
    weighted by the off-policy correction from its behaviour log-prob; the rollout-vs-trainer
    log-prob gap and the importance ratio per staleness level measured on the same forward
    pass, before the update."""
    samples, advantages, lags = [], [], []
    token_lags = iter(batch.token_lags_numpy())  # per sample, aligned with its behaviour log-probs
    for group in batch.groups:
        rewards = torch.tensor([s.reward for s in group.samples], dtype=torch.float32)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4) if len(rewards) > 1 else rewards * 0
        for sample, a in zip(group.samples, adv.tolist(), strict=True):
            lag = next(token_lags)
            if sample.response_length > 0 and sample.rollout_log_probs is not None:
                samples.append(sample)
                advantages.append(a)
                lags.append(torch.zeros(sample.response_length, dtype=torch.int32) if lag is None
                            else torch.from_numpy(lag.copy()))
    model.train()
    new = response_logprobs(model, samples, pad_id)
    gaps, gaps_onpolicy = [], []
    ratios: dict[int, list[float]] = {}
    total_tokens = sum(s.response_length for s in samples)
    loss = torch.zeros(())
    masked = 0
    for sample, logp, adv, lag in zip(samples, new, advantages, lags, strict=True):
        old = torch.tensor(list(sample.rollout_log_probs), dtype=torch.float32)
        gap = (logp.detach() - old).abs()
        gaps.append(gap)
        gaps_onpolicy.append(gap[lag == 0])
        weights, ratio = importance_weights(logp, old, args.correction, args.is_cap)
        weights, dropped = mask_by_lag(weights, lag, args.max_token_lag)
        masked += dropped
        for level in lag.unique().tolist():  # each token under its own lag (a continued sample spans several)
            ratios.setdefault(level, []).extend(ratio[lag == level].tolist())
        # d/dθ exp(logp - sg(logp)) = ∇ logp: the policy gradient at the trainer's weights
        loss = loss - (weights * adv * torch.exp(logp - logp.detach())).sum() / total_tokens
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    every = torch.cat(gaps) if gaps else torch.zeros(1)
    onpolicy = torch.cat(gaps_onpolicy) if gaps_onpolicy else torch.zeros(0)
    onpolicy = onpolicy if len(onpolicy) else torch.full((1,), math.nan)
    stats = ratio_stats(ratios)
    stale_tokens = [r for s, values in ratios.items() if s > 0 for r in values]
    return {
        "loss": loss.item(),
        "logprob_gap_mean": float(every.mean()),
        "logprob_gap_max": float(every.max()),
        "logprob_gap_onpolicy_max": float(onpolicy.max()),
        "ratio": stats,
        "ratio_s0_max_dev": stats["0"]["max_dev"] if "0" in stats else math.nan,
        "ratio_p99": quantile(stale_tokens, 0.99) if stale_tokens else math.nan,
        "samples": float(len(samples)),
        "response_tokens": float(total_tokens),
        "tokens_masked_by_lag": float(masked),
        "token_lag_mean": float(torch.cat(lags).double().mean()) if lags else 0.0,
        "token_lag_max": float(max((int(x.max()) for x in lags if len(x)), default=0)),
    }


# -- the run --------------------------------------------------------------------------------


def engine_generated_tokens(engine: str) -> float | None:
    """vLLM's ``vllm:generation_tokens_total`` (every token it generated, aborted ones included):
    over the response tokens trained, what the cadence threw away; None when unreadable."""
    import httpx

    try:
        text = httpx.get(engine + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    total = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("vllm:generation_tokens_total")]
    return sum(total) if total else None


def _cli(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "rollstream.cli", *args, "--log-level", "WARNING"], check=True)


async def train(args: argparse.Namespace, model: Any, tokenizer: Any, redis_url: str, engine: str,
                weights: Path, on_row: Any) -> tuple[list[dict[str, Any]], Snapshots, str]:
    """The training loop; returns the rows, the eval snapshots ``{version: (wall_s, state)}``
    and why it stopped. ``wall_s`` counts from the first batch taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    rows: list[dict[str, Any]] = []
    snapshots = {0: (0.0, {k: v.detach().clone() for k, v in model.state_dict().items()})}
    stopped = f"{args.steps} steps"
    async with (
        GroupConsumer.connect(redis_url, "tiny", "trainer", stall_timeout=args.take_timeout) as consumer,
        WeightSync([engine], kind="vllm") as sync,
    ):
        # The clock starts once the first batch is in: the pipeline's start (the producers'
        # imports, vLLM's first requests: ~10 s) is the same in every schedule and not training.
        started: float | None = None
        for step in range(args.steps):
            if args.budget_s is not None and started is not None and time.monotonic() - started >= args.budget_s:
                stopped = f"budget of {args.budget_s:.0f} s"
                break
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(args.take_timeout):
                    batch = await consumer.take(args.batch_size)
            except TimeoutError:
                stopped = f"take() waited over {args.take_timeout:.0f} s at step {step}"
                logger.error("%s: stopping the run", stopped)
                break
            t1 = time.monotonic()
            started = t1 if started is None else started
            stats = grpo_step(model, optimizer, batch, tokenizer.pad_token_id, args)
            schedule.step()
            await consumer.commit(batch)
            version = batch.weight_version + 1
            path = save_weights(model, weights / f"v{version}")
            report = await sync.update(consumer, str(path), version, mode=args.mode)
            t2 = time.monotonic()
            wall = t2 - started
            if (step + 1) % args.eval_every == 0:
                snapshots[step + 1] = (wall, {k: v.detach().clone() for k, v in model.state_dict().items()})
            row = {"step": float(step), "wall_s": wall, "generate_s": t1 - t0, "train_s": t2 - t1,
                   "sync_s": report.total, **batch.metrics, **stats}
            rows.append(row)
            on_row(rows)
    return rows, snapshots, stopped


def evaluate(model: Any, tokenizer: Any, snapshots: Snapshots,
             pairs: list[tuple[int, int]]) -> list[dict[str, float]]:
    """The eval reward of every snapshot, in step order (after the run: off the training path)."""
    points = []
    for step in sorted(snapshots):
        wall, state = snapshots[step]
        model.load_state_dict(state)
        points.append({"step": float(step), "wall_s": wall, "reward": expected_reward(model, tokenizer, pairs)})
    return points


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]], points: list[dict[str, float]],
              stopped: str) -> dict[str, Any]:
    """What the run reached: time and step to the target (or the best it got), G, T, the bound."""
    reached = first_reaching([(int(p["step"]), p["wall_s"], p["reward"]) for p in points], args.target)
    best = max(points, key=lambda p: p["reward"])
    timed = rows[1:] or rows  # the first step also waits for the pipeline to fill
    generate = statistics.median(r["generate_s"] for r in timed) if timed else math.nan
    train_s = statistics.median(r["train_s"] for r in timed) if timed else math.nan
    bound = Bound(generate, train_s) if timed else None
    s0 = [r["ratio_s0_max_dev"] for r in rows if not math.isnan(r["ratio_s0_max_dev"])]
    return {
        "schedule": args.schedule, "max_staleness": args.max_staleness, "partial_rollout": args.partial_rollout,
        "staleness_rule": args.staleness_rule, "max_token_lag": args.max_token_lag,
        "correction": args.correction, "target": args.target, "reached": reached is not None,
        "steps_to_target": reached[0] if reached else None, "time_to_target_s": reached[1] if reached else None,
        "best_eval": best["reward"], "best_eval_step": best["step"], "steps": len(rows), "stopped": stopped,
        "wall_s": rows[-1]["wall_s"] if rows else 0.0,
        "s_per_step": (rows[-1]["wall_s"] - rows[0]["wall_s"]) / (len(rows) - 1) if len(rows) > 1 else math.nan,
        "generate_s_median": generate, "train_s_median": train_s,
        "bound_speedup": bound.speedup if bound else math.nan,
        "ratio_s0_max_dev": max(s0) if s0 else math.nan,
        "ratio_s0_ok": max(s0) < STALENESS_ZERO_TOLERANCE if s0 else None,
    }


def plot(rows: list[dict[str, Any]], points: list[dict[str, float]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    ax = axes[0][0]
    ax.plot(steps, [r["reward_mean"] for r in rows], marker="o", ms=3, label="training batch")
    ax.plot([p["step"] - 1 for p in points], [p["reward"] for p in points], marker="s", ms=3,
            label="eval (exact, every pair)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (exact sum)")
    ax.set_title("reward vs step")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot([p["wall_s"] for p in points], [p["reward"] for p in points], marker="s", ms=3)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("eval reward (exact expected)")
    ax.set_title("eval reward vs wall time")
    ax = axes[0][2]
    ax.semilogy(steps, [r["logprob_gap_mean"] for r in rows], marker="o", ms=3, label="mean, all samples")
    ax.semilogy(steps, [r["logprob_gap_max"] for r in rows], marker="x", ms=3, label="max, all samples")
    ax.semilogy(steps, [r["logprob_gap_onpolicy_max"] for r in rows], marker=".", ms=3, label="max, staleness 0")
    ax.set_xlabel("step")
    ax.set_ylabel("|rollout - trainer| log-prob")
    ax.set_title("rollout-vs-trainer log-prob gap")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    levels = sorted({int(k) for r in rows for k in r["ratio"]})
    for level in levels:
        got = [(r["step"], r["ratio"][str(level)]) for r in rows if str(level) in r["ratio"]]
        line = ax.plot([g[0] for g in got], [g[1]["mean"] for g in got], marker=".", ms=3, label=f"staleness {level}")
        ax.fill_between([g[0] for g in got], [g[1]["p1"] for g in got], [g[1]["p99"] for g in got],
                        color=line[0].get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("importance ratio trainer / behaviour")
    ax.set_title("ratio per staleness: mean, p1..p99")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(steps, [r["staleness_mean"] for r in rows], marker="o", ms=3, label="mean")
    ax.plot(steps, [r["staleness_max"] for r in rows], marker="x", ms=3, label="max")
    ax.set_xlabel("step")
    ax.set_ylabel("staleness (versions)")
    ax.legend(fontsize=8)
    ax = axes[1][2]
    ax.plot(steps, [r["generate_s"] for r in rows], marker="o", ms=3, label="G: waiting in take()")
    ax.plot(steps, [r["train_s"] for r in rows], marker="x", ms=3, label="T: train + save + weight sync")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("per-step generation wait and training")
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "learning.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key, math.nan)
    return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop vLLM and the children on SIGTERM too
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    console = Console()
    started = time.monotonic()
    out = Path(args.out) if args.out else Path("runs") / time.strftime("tiny-grpo-%Y%m%d-%H%M%S")
    train_pairs, heldout_pairs = split_pairs(args.max_operand, args.heldout)
    eval_pairs = heldout_pairs or train_pairs
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-tiny-")))
        model_dir = build_model(work / "model")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
        sft_loss = sft_warmup(model, tokenizer, args, train_pairs)
        v0 = save_weights(model, work / "weights" / "v0")
        tokenizer.save_pretrained(str(v0))
        env: dict[str, str] = {}
        if args.cpus is not None:
            engine_cpus = args.cpus[0]
            pin_process(engine_cpus)  # vLLM, Redis, the feeder and the producers inherit it
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(engine_cpus))
        console.print(f"[bold]tiny GRPO[/] ({args.schedule}: max_staleness {args.max_staleness}, partial rollout "
                      f"{'on' if args.partial_rollout else 'off'}, correction {args.correction}): model built and "
                      f"warmed up (SFT loss {sft_loss:.3f}) in {time.monotonic() - started:.0f} s; starting vLLM "
                      f"(logs in {work}; cores engine / trainer: "
                      f"{'not pinned' if args.cpus is None else ' / '.join(str(sorted(c)) for c in args.cpus)})")
        engine = stack.enter_context(vllm_server(v0, free_port(), work / "vllm.log", extra_env=env))
        redis = stack.enter_context(EmbeddedRedis(dir=work / "redis"))
        data = work / "addition.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in task_records(train_pairs, 4000, args.seed)))
        init = ["init", "--redis", redis.url, "--ns", "tiny", "--n-samples", str(args.n_samples),
                "--batch-size", str(args.batch_size), "--max-staleness", str(args.max_staleness),
                "--max-backlog", str(4 * args.batch_size), "--lease", "60", "--staleness-rule", args.staleness_rule,
                "--force"]
        _cli(init + (["--partial-rollout"] if args.partial_rollout else []))
        children: list[subprocess.Popen[bytes]] = []
        stack.callback(stop_processes, children)
        children.append(start_cli(["feed", str(data), "--redis", redis.url, "--ns", "tiny", "--forever",
                                   "--shuffle", "--seed", str(args.seed), "--window", str(8 * args.batch_size)],
                                  work / "feeder.log"))
        for i in range(args.producers):
            children.append(start_cli(
                ["produce", "--redis", redis.url, "--ns", "tiny", "--engine", engine, "--engine-api", "vllm",
                 "--tokenizer", str(v0), "--concurrency", str(args.concurrency), "--max-new-tokens", "8",
                 "--reward", "rollstream.testing.tiny_model:exact_reward", "--name", f"producer-{i}"],
                work / f"producer-{i}.log"))
        if args.cpus is not None:
            pin_process(args.cpus[1])
        torch.set_num_threads(args.threads or (len(args.cpus[1]) if args.cpus else 1))

        async def run() -> tuple[list[dict[str, Any]], Snapshots, str]:
            async with WeightSync([engine]) as sync:
                await sync.set_version(0)
            live_output = console.is_terminal

            def table(rows: list[dict[str, Any]]) -> Table:
                t = Table(title=f"tiny GRPO through rollstream (vLLM, CPU, {args.schedule})")
                for title, _, _ in COLUMNS:
                    t.add_column(title, justify="right")
                for row in rows[-25:]:
                    t.add_row(*(_fmt(row, key, fmt) for _, key, fmt in COLUMNS))
                return t

            live = Live(table([]), console=console, refresh_per_second=4) if live_output else None

            def on_row(rows: list[dict[str, Any]]) -> None:
                if live is not None:
                    live.update(table(rows))
                else:
                    console.print("  ".join(f"{t}={_fmt(rows[-1], k, f)}" for t, k, f in COLUMNS))

            with live if live is not None else contextlib.nullcontext():
                return await train(args, model, tokenizer, redis.url, engine, work / "weights", on_row)

        try:
            rows, snapshots, stopped = asyncio.run(run())
            generated = engine_generated_tokens(engine)
        except BaseException:
            for log in sorted(work.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                if tail:
                    console.print(f"--- {log.name} ---\n" + "\n".join(tail))
            raise
        stop_processes(children)
    points = evaluate(model, tokenizer, snapshots, eval_pairs)
    summary = summarize(args, rows, points, stopped)
    summary["total_s"] = time.monotonic() - started  # set-up, training and the eval
    trained = sum(r["response_tokens"] for r in rows)
    summary["engine_generated_tokens"] = generated
    summary["generated_per_trained"] = generated / trained if generated is not None and trained else None
    out.mkdir(parents=True, exist_ok=True)
    saved = {k: v for k, v in vars(args).items() if k != "cpus"}
    saved["cpus"] = None if args.cpus is None else [sorted(c) for c in args.cpus]
    (out / "steps.json").write_text(json.dumps(
        {"args": saved, "summary": summary, "eval": points, "rows": rows}, indent=1))
    if summary["reached"]:
        verdict = (f"eval reward {args.target} reached at step {summary['steps_to_target']}, "
                   f"{summary['time_to_target_s']:.1f} s of training")
    else:
        verdict = (f"eval reward {args.target} NOT reached ({stopped}): best {summary['best_eval']:.3f} at step "
                   f"{summary['best_eval_step']:.0f}")
    s0_verdict = {True: "ok", False: "NOT 1: the log-probs are not the behaviour policy's",
                  None: "no staleness-0 token"}[summary["ratio_s0_ok"]]
    console.print(f"\n[bold]done[/] ({stopped}) in {time.monotonic() - started:.0f} s: eval "
                  f"{points[0]['reward']:.3f} -> {points[-1]['reward']:.3f}; {verdict}; "
                  f"G {summary['generate_s_median']:.2f} s, T {summary['train_s_median']:.2f} s per step "
                  f"(bound {summary['bound_speedup']:.2f}x); ratio at staleness 0: max |r - 1| "
                  f"{summary['ratio_s0_max_dev']:.1e} ({s0_verdict}); "
                  f"steps in {out / 'steps.json'}")
    if not args.no_plot:
        path = plot(rows, points, out, f"tiny Llama learns addition with GRPO through rollstream (vLLM CPU, "
                                       f"{args.schedule}, max_staleness {args.max_staleness}, {args.correction})")
        console.print(f"plot: {path.resolve()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
