"""``python -m bench [--quick] [NAME ...]``: run the benchmarks, print markdown tables.

Tables also go to ``bench/out/<name>.md`` (and ``bench/out/results.md`` for the whole run);
plots to ``docs/img/``. Names: codec, throughput, take, latency, async_vs_sync, memory, scaleout, r3, episodes, adapters,
restart, reply_bound, one_flag, diagnose, redis_memory, fleet, joining, loop_stall, learning_sim, bias, staleness_rule,
durable, archive, archive_read, path, shuffle_memory, mooncake_store, eval_submit, payload (also ``episodes --kill``); and, run only by name: data (it writes 10M-row JSONL and Parquet
files, ~1 GB, under $ROLLSTREAM_BENCH_DATA or /tmp: bench/data.py), scale (it needs root for its network namespaces:
bench/scale.py, docs/scale.md) and learning (real vLLM runs, ~30 min: bench/learning.py).
"""

from __future__ import annotations

import argparse
import importlib
import time

from bench.common import OUT, Table, machine

BENCHMARKS = (
    "codec", "throughput", "take", "latency", "async_vs_sync", "memory", "scaleout", "r3", "episodes", "adapters",
    "restart", "reply_bound", "one_flag", "diagnose", "redis_memory", "fleet", "joining", "loop_stall", "learning_sim",
    "bias", "staleness_rule", "durable", "archive", "archive_read", "path", "shuffle_memory", "mooncake_store",
    "eval_submit", "payload", "data", "scale", "learning",
)
DEFAULT = tuple(name for name in BENCHMARKS if name not in ("scale", "learning", "data"))
"""What ``python -m bench`` runs without names (scale needs root and takes minutes of its own; learning
needs the vLLM venv and half an hour)."""


def run(names: list[str], quick: bool) -> list[Table]:
    OUT.mkdir(parents=True, exist_ok=True)
    tables: list[Table] = []
    for name in names:
        started = time.monotonic()
        module = importlib.import_module(f"bench.{name}")
        produced: list[Table] = module.run(quick=quick)
        for table in produced:
            text = table.markdown() + f"\n_({time.monotonic() - started:.0f} s)_\n"
            print(text, flush=True)
            (OUT / f"{table.name}{'-quick' if quick else ''}.md").write_text(text)
        tables += produced
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: {', '.join(DEFAULT)}); also: scale, learning")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--kill", action="store_true",
                        help="with episodes: a producer killed midway through durable episodes (bench/durable.py)")
    args = parser.parse_args()
    names = args.names or list(DEFAULT)
    if args.kill:
        names = ["durable" if name == "episodes" else name for name in names]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    print(f"machine: {machine()}\n", flush=True)
    tables = run(names, args.quick)
    if not args.quick and set(names) == set(DEFAULT):
        (OUT / "results.md").write_text(f"machine: {machine()}\n\n" + "\n".join(t.markdown() for t in tables))


if __name__ == "__main__":
    main()
