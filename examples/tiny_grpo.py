"""A real learning run through rollstream on a CPU: a tiny Llama learns addition with GRPO.

One command (``rollstream demo --real [FLAGS]`` or ``./scripts/demo --real``: they build the vLLM venv
on first use; or ``.venv-vllm/bin/python examples/tiny_grpo.py``):
build the tiny model (rollstream.testing.tiny_model), warm it up with a short SFT in torch,
start vLLM on it, an embedded Redis, the feeder and the producers (``--engine-api vllm``), then
train with GRPO: take a batch, recompute the samples' log-probs with the trainer's weights (the
rollout-vs-trainer log-prob gap), one clipped policy-gradient step, save the weights and move
vLLM and rollstream to the new version with :class:`rollstream.engines.WeightSync`. A live table
per step; ``steps.json`` and ``learning.png`` (reward vs step and wall time, staleness, the
log-prob gap, recycled counts) in ``--out``.

Reading the log-prob gap (``|rollout - trainer|`` per response token, mean and max per step):
a sample generated on the weights the trainer holds (staleness 0) agrees to ~1e-5 in fp32; a
stale sample differs by what one optimizer step moved (here ~1e-2 .. 1e-1, larger with a larger
learning rate); a token misaligned between prompt and response (or a wrong version label) is
off by whole nats (> 1). The trainer's importance ratio corrects the stale ones; the last kind
is a bug.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rollstream import GroupConsumer, WeightSync
from rollstream.testing.children import start_cli, stop_processes
from rollstream.testing.server import EmbeddedRedis, free_port
from rollstream.testing.tiny_model import addition_prompts, build_model, save_weights
from rollstream.testing.vllm_server import vllm_server

logger = logging.getLogger("tiny_grpo")

COLUMNS = (
    ("step", "step", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("wall s", "wall_s", "{:.0f}"),
    ("stale", "staleness_mean", "{:.2f}"),
    ("gap mean", "logprob_gap_mean", "{:.1e}"),
    ("gap max", "logprob_gap_max", "{:.1e}"),
    ("gap on-pol max", "logprob_gap_onpolicy_max", "{:.1e}"),
    ("recyc abort", "recycled_aborted", "{:.0f}"),
    ("recyc stale", "recycled_stale", "{:.0f}"),
    ("sync s", "sync_s", "{:.2f}"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="groups per step")
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64, help="samples in flight per producer")
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--sft-steps", type=int, default=70)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=5, help="linear lr warm-up")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--mode", default="abort", choices=["abort", "wait", "keep"], help="engine pause mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--out", default=None, help="directory for steps.json and learning.png")
    p.add_argument("--workdir", default=None, help="keep the model, weights and logs here")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


# -- the model side -------------------------------------------------------------------------


def sft_warmup(model: Any, tokenizer: Any, args: argparse.Namespace) -> float:
    """A short supervised warm-up on ``A+B=C<eos>``: the model learns the format and some sums."""
    rng = random.Random(args.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr)
    model.train()
    loss_value = math.nan
    for _ in range(args.sft_steps):
        rows = []
        for _ in range(64):
            a, b = rng.randint(0, args.max_operand), rng.randint(0, args.max_operand)
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


def response_logprobs(model: Any, samples: list[Any], pad_id: int) -> list[torch.Tensor]:
    """Log-probs of each sample's response tokens under ``model`` (with grad if enabled)."""
    width = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), width), pad_id)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.tensor(list(s.tokens))
        mask[i, : len(s.tokens)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = []
    for i, s in enumerate(samples):
        start = s.prompt_length - 1
        out.append(logp[i, start : start + s.response_length])
    return out


def grpo_step(model: Any, optimizer: Any, batch: Any, pad_id: int, clip: float) -> dict[str, float]:
    """One clipped policy-gradient step over the batch (group-normalised advantages); the
    rollout-vs-trainer log-prob gap measured on the same forward pass, before the update."""
    samples, advantages, staleness = [], [], []
    for group in batch.groups:
        rewards = torch.tensor([s.reward for s in group.samples], dtype=torch.float32)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4) if len(rewards) > 1 else rewards * 0
        for sample, a in zip(group.samples, adv.tolist(), strict=True):
            if sample.response_length > 0 and sample.rollout_log_probs is not None:
                samples.append(sample)
                advantages.append(a)
                staleness.append(batch.weight_version - min(sample.weight_versions))
    model.train()
    new = response_logprobs(model, samples, pad_id)
    gaps, gaps_onpolicy = [], []
    total_tokens = sum(s.response_length for s in samples)
    loss = torch.zeros(())
    for sample, logp, adv, stale in zip(samples, new, advantages, staleness, strict=True):
        old = torch.tensor(list(sample.rollout_log_probs), dtype=torch.float32)
        gap = (logp.detach() - old).abs()
        gaps.append(gap)
        if stale == 0:
            gaps_onpolicy.append(gap)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        loss = loss - surrogate.sum() / total_tokens
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    every = torch.cat(gaps) if gaps else torch.zeros(1)
    onpolicy = torch.cat(gaps_onpolicy) if gaps_onpolicy else torch.full((1,), math.nan)
    return {
        "loss": loss.item(),
        "logprob_gap_mean": float(every.mean()),
        "logprob_gap_max": float(every.max()),
        "logprob_gap_onpolicy_max": float(onpolicy.max()),
        "samples": float(len(samples)),
        "response_tokens": float(total_tokens),
    }


# -- the run --------------------------------------------------------------------------------


def _cli(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "rollstream.cli", *args, "--log-level", "WARNING"], check=True)


async def train(args: argparse.Namespace, model: Any, tokenizer: Any, redis_url: str, engine: str,
                weights: Path, started: float, on_row: Any) -> list[dict[str, float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    rows: list[dict[str, float]] = []
    async with (
        GroupConsumer.connect(redis_url, "tiny", "trainer", stall_timeout=300) as consumer,
        WeightSync([engine], kind="vllm") as sync,
    ):
        for step in range(args.steps):
            batch = await consumer.take(args.batch_size)
            stats = grpo_step(model, optimizer, batch, tokenizer.pad_token_id, args.clip)
            schedule.step()
            await consumer.commit(batch)
            version = batch.weight_version + 1
            path = save_weights(model, weights / f"v{version}")
            report = await sync.update(consumer, str(path), version, mode=args.mode)
            row = {"step": float(step), "wall_s": time.monotonic() - started, "sync_s": report.total,
                   **batch.metrics, **stats}
            rows.append(row)
            on_row(rows)
    return rows


def plot(rows: list[dict[str, float]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(steps, [r["reward_mean"] for r in rows], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (exact sum)")
    ax.set_title("reward vs step")
    twin = ax.twiny()
    twin.plot([r["wall_s"] for r in rows], [r["reward_mean"] for r in rows], alpha=0)
    twin.set_xlabel("wall time (s)")
    ax = axes[0][1]
    ax.semilogy(steps, [r["logprob_gap_mean"] for r in rows], marker="o", ms=3, label="mean, all samples")
    ax.semilogy(steps, [r["logprob_gap_max"] for r in rows], marker="x", ms=3, label="max, all samples")
    ax.semilogy(steps, [r["logprob_gap_onpolicy_max"] for r in rows], marker=".", ms=3, label="max, staleness 0")
    ax.set_xlabel("step")
    ax.set_ylabel("|rollout - trainer| log-prob")
    ax.set_title("rollout-vs-trainer log-prob gap")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(steps, [r["staleness_mean"] for r in rows], marker="o", ms=3, label="mean")
    ax.plot(steps, [r["staleness_max"] for r in rows], marker="x", ms=3, label="max")
    ax.set_xlabel("step")
    ax.set_ylabel("staleness (versions)")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(steps, [r["recycled_aborted"] for r in rows], marker="o", ms=3, label="recycled aborted")
    ax.plot(steps, [r["recycled_stale"] for r in rows], marker="x", ms=3, label="recycled stale")
    ax.set_xlabel("step")
    ax.set_ylabel("groups recycled in the step's take")
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "learning.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(row: dict[str, float], key: str, fmt: str) -> str:
    value = row.get(key, math.nan)
    return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop vLLM and the children on SIGTERM too
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    console = Console()
    started = time.monotonic()
    out = Path(args.out) if args.out else Path("runs") / time.strftime("tiny-grpo-%Y%m%d-%H%M%S")
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-tiny-")))
        model_dir = build_model(work / "model")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
        sft_loss = sft_warmup(model, tokenizer, args)
        v0 = save_weights(model, work / "weights" / "v0")
        tokenizer.save_pretrained(str(v0))
        console.print(f"[bold]tiny GRPO[/]: model built and warmed up (SFT loss {sft_loss:.3f}) "
                      f"in {time.monotonic() - started:.0f} s; starting vLLM (logs in {work})")
        engine = stack.enter_context(vllm_server(v0, free_port(), work / "vllm.log"))
        redis = stack.enter_context(EmbeddedRedis(dir=work / "redis"))
        data = work / "addition.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in addition_prompts(
            4000, max_operand=args.max_operand, seed=args.seed)))
        _cli(["init", "--redis", redis.url, "--ns", "tiny", "--n-samples", str(args.n_samples),
              "--batch-size", str(args.batch_size), "--max-staleness", str(args.max_staleness),
              "--max-backlog", str(4 * args.batch_size), "--lease", "60", "--force"])
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

        async def run() -> list[dict[str, float]]:
            async with WeightSync([engine]) as sync:
                await sync.set_version(0)
            live_output = console.is_terminal

            def table(rows: list[dict[str, float]]) -> Table:
                t = Table(title="tiny GRPO through rollstream (vLLM, CPU)")
                for title, _, _ in COLUMNS:
                    t.add_column(title, justify="right")
                for row in rows[-25:]:
                    t.add_row(*(_fmt(row, key, fmt) for _, key, fmt in COLUMNS))
                return t

            live = Live(table([]), console=console, refresh_per_second=4) if live_output else None

            def on_row(rows: list[dict[str, float]]) -> None:
                if live is not None:
                    live.update(table(rows))
                else:
                    console.print("  ".join(f"{t}={_fmt(rows[-1], k, f)}" for t, k, f in COLUMNS))

            with live if live is not None else contextlib.nullcontext():
                return await train(args, model, tokenizer, redis.url, engine, work / "weights", started, on_row)

        try:
            rows = asyncio.run(run())
        except BaseException:
            for log in sorted(work.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                if tail:
                    console.print(f"--- {log.name} ---\n" + "\n".join(tail))
            raise
        stop_processes(children)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    first = sum(r["reward_mean"] for r in rows[:3]) / min(3, len(rows))
    last = sum(r["reward_mean"] for r in rows[-3:]) / min(3, len(rows))
    console.print(f"\n[bold]done[/] in {time.monotonic() - started:.0f} s: reward {first:.3f} (first 3 steps) -> "
                  f"{last:.3f} (last 3); steps in {out / 'steps.json'}")
    if not args.no_plot:
        path = plot(rows, out, f"tiny Llama learns addition with GRPO through rollstream "
                               f"(vLLM CPU, max_staleness {args.max_staleness})")
        console.print(f"plot: {path.resolve()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
