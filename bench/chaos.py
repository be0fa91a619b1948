"""Chaos run: kill anything at any time, then prove that nothing was lost and nothing doubled.

``python -m bench.chaos [--steps 60] [--producers 4] [--kill-every 2.5] ...`` starts, all as real
processes: an AOF-backed redis-server (``appendfsync always``), the engine simulator, a feeder,
``--producers`` producers and a trainer. While the trainer works through ``--steps`` batches,
it SIGKILLs a random producer every ``--kill-every`` seconds and restarts it (every other time
under the same name, so it adopts its own pending prompts; else under a new name, so the others
reclaim them after the lease), SIGKILLs the trainer once between ``take`` and ``commit`` and
restarts it, and SIGKILLs and restarts Redis once.

The dataset has ``steps x batch`` ordinary prompts plus ``--poison`` prompts the engine refuses
(HTTP 400): their groups fail, are recycled ``max_attempts`` times and end in the dead-letter
stream, which exercises the recycle and dead-letter paths under the same chaos.

The trainer writes each batch (id, indexes) to a JSONL file, fsynced, *before* committing it,
so the batch redelivered after its kill appears twice with the same id. After the last step the
run drains: killing stops, the poison prompts are given time to reach the dead-letter stream,
then the producers get SIGTERM (in-flight groups published or prompts returned). The accounting
is then exact: each fed index must sit in exactly one place among

* committed (the trainer's JSONL, the redelivered batch counted once),
* the dead-letter stream (with its reason),
* the groups stream (published, not trained yet),
* the prompts stream (queued, or returned by a draining producer),

and the trainer's JSONL may repeat only the one batch redelivered after its kill, with the same
id. Exit status 0 only when lost = 0 and duplicated = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.runtime.children import stop_processes, wait_for_http
from rollstream.runtime.redis_server import EmbeddedRedis, free_port

NS = "chaos"
TRAINER_NAME = "trainer-0"


# -- the trainer process -------------------------------------------------------------------------


def _recorded_ids(record: Path) -> set[str]:
    if not record.exists():
        return set()
    return {json.loads(line)["id"] for line in record.read_text().splitlines() if line.strip()}


def _append_fsynced(record: Path, line: dict[str, Any]) -> None:
    with open(record, "a") as handle:
        handle.write(json.dumps(line) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _first_hang(flag: Path, batch_id: str) -> bool:
    if flag.exists():
        return False
    flag.write_text(batch_id)
    return True


async def trainer_main(url: str, steps: int, batch: int, record: Path, hang_at: int, flag: Path) -> None:
    """Take/commit ``steps`` batches; record each before commit; hang once at ``hang_at``."""
    from rollstream.consumer import GroupConsumer

    done = _recorded_ids(record)
    async with await GroupConsumer.connect(url, NS, TRAINER_NAME, stall_timeout=120) as consumer:
        while len(done) < steps:
            taken = await consumer.take(batch)
            line = {"id": taken.id, "indexes": [g.index for g in taken.groups], "redelivered": taken.redelivered,
                    "pid": os.getpid(), "step": len(done)}
            _append_fsynced(record, line)
            if len(done) == hang_at and _first_hang(flag, taken.id):
                await asyncio.sleep(3600)  # "training": the harness SIGKILLs us here
            await consumer.commit(taken)
            done.add(taken.id)


# -- the harness ---------------------------------------------------------------------------------


class Harness:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        self.children: list[subprocess.Popen[bytes]] = []
        self.producers: dict[int, subprocess.Popen[bytes]] = {}
        self.names: dict[int, str] = {}
        self.generation = Counter[int]()
        self.kills = Counter[str]()
        self.record = work / "trainer.jsonl"
        self.flag = work / "trainer-hang.flag"

    def spawn(self, log: str, *argv: str) -> subprocess.Popen[bytes]:
        with open(self.work / f"{log}.log", "ab") as handle:
            child = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append(child)
        return child

    def cli(self, log: str, *argv: str) -> subprocess.Popen[bytes]:
        return self.spawn(log, sys.executable, "-m", "rollstream.cli", *argv)

    def start_producer(self, slot: int, url: str, engine: str) -> None:
        # Every other restart reuses the name: that producer adopts its own pending prompts.
        if self.generation[slot] % 2 == 1:
            self.names[slot] = f"p{slot}-g{self.generation[slot]}"
        else:
            self.names.setdefault(slot, f"p{slot}-g0")
        self.generation[slot] += 1
        self.producers[slot] = self.cli(
            f"producer-{slot}", "produce", "--redis", url, "--ns", NS, "--engine", engine,
            "--concurrency", str(self.args.concurrency), "--reward", "math", "--max-new-tokens", "256",
            "--heartbeat-interval", "0.5", "--drain-timeout", "10", "--name", self.names[slot],
            "--log-level", "INFO",
        )

    def start_trainer(self, url: str) -> subprocess.Popen[bytes]:
        return self.spawn(
            "trainer", sys.executable, "-m", "bench.chaos", "--trainer", "--redis", url,
            "--steps", str(self.args.steps), "--batch-size", str(self.args.batch_size),
            "--record", str(self.record), "--hang-at", str(self.args.trainer_kill_at), "--flag", str(self.flag),
        )

    def records(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]

    def stop_all(self) -> None:
        stop_processes(self.children, timeout=15)


def write_dataset(path: Path, good: int, poison: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(good):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": f"Compute {a} + {b} and box it.", "label": str(a + b), "id": i})
    for j in range(poison):
        rows.insert(rng.randrange(len(rows) + 1), {"prompt": f"POISON {j}: the engine refuses this", "label": "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


async def all_running(url: str, pids: dict[str, int]) -> bool:
    """Every producer process has sent a heartbeat of its own (the pid tells it from its predecessor)."""
    redis = connect(url)
    try:
        beats = await redis.hmget(Keys(NS).producers, list(pids))
    finally:
        await redis.aclose()
    return all(
        b is not None and json.loads(b).get("state") == "running" and json.loads(b).get("pid") == pid
        for b, pid in zip(beats, pids.values(), strict=True)
    )


async def snapshot(url: str) -> dict[str, Any]:
    """Every index where it sits now: dead (with reason), groups stream, prompts stream; counters."""
    keys = Keys(NS)
    redis = connect(url)
    try:
        dead = [(int(f[b"index"]), f[b"reason"].decode()) for _, f in await redis.xrange(keys.dead)]
        groups = [int(f[b"index"]) for _, f in await redis.xrange(keys.groups)]
        prompts = [int(f[b"index"]) for _, f in await redis.xrange(keys.prompts)]
        state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
        pending_prompts = (await redis.xpending(keys.prompts, "producers"))["pending"]
    finally:
        await redis.aclose()
    return {"dead": dead, "groups": groups, "prompts": prompts, "state": state, "pending_prompts": pending_prompts}


def run(args: argparse.Namespace) -> int:
    work = Path(args.out or tempfile.mkdtemp(prefix="rollstream-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    good = args.steps * args.batch_size
    dataset = work / "dataset.jsonl"
    write_dataset(dataset, good, args.poison, args.seed)
    fed_total = good + args.poison
    h = Harness(args, work)
    started = time.monotonic()
    server = EmbeddedRedis(dir=work / "redis", appendonly=True, appendfsync="always").start()
    url = server.url
    try:
        engine_port = free_port()
        engine = f"http://127.0.0.1:{engine_port}"
        h.cli("sim", "sim-engine", "--port", str(engine_port), "--mean-tokens", str(args.mean_tokens),
              "--latency-per-token", str(args.latency_per_token), "--accuracy", "0.6", "--seed", str(args.seed))
        wait_for_http(engine)
        subprocess.run(
            [sys.executable, "-m", "rollstream.cli", "init", "--redis", url, "--ns", NS, "--n-samples",
             str(args.n_samples), "--batch-size", str(args.batch_size), "--lease", str(args.lease),
             "--max-attempts", str(args.max_attempts), "--max-backlog", "64"],
            check=True, capture_output=True,
        )
        h.cli("feeder", "feed", "--redis", url, "--ns", NS, str(dataset), "--window", "48")
        for slot in range(args.producers):
            h.start_producer(slot, url, engine)
        trainer = h.start_trainer(url)
        next_kill = time.monotonic() + args.kill_every
        redis_restarted = False
        trainer_killed = False
        deadline = time.monotonic() + args.timeout
        while True:
            if trainer.poll() is not None:
                if trainer.returncode == 0:
                    break
                raise RuntimeError(f"trainer exited with {trainer.returncode}; see {work / 'trainer.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run did not finish within {args.timeout} s; logs in {work}")
            done = len({r["id"] for r in h.records()})
            if not trainer_killed and h.flag.exists():
                time.sleep(0.2)  # the batch is recorded and not committed: kill it now
                trainer.send_signal(signal.SIGKILL)
                trainer.wait()
                h.kills["trainer"] += 1
                trainer_killed = True
                print(f"[{time.monotonic() - started:5.1f}s] SIGKILL trainer between take and commit", flush=True)
                trainer = h.start_trainer(url)
            if not redis_restarted and done >= args.steps * 0.4:
                redis_restarted = True
                print(f"[{time.monotonic() - started:5.1f}s] SIGKILL redis-server, restart from the AOF", flush=True)
                server.restart(kill=True, down_for=1.0)
                h.kills["redis"] += 1
            if time.monotonic() >= next_kill:
                next_kill = time.monotonic() + args.kill_every
                slot = h.rng.randrange(args.producers)
                victim = h.producers[slot]
                if victim.poll() is None:
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    h.kills["producer"] += 1
                    print(f"[{time.monotonic() - started:5.1f}s] SIGKILL producer {h.names[slot]} "
                          f"(step {done}/{args.steps})", flush=True)
                else:
                    print(f"[{time.monotonic() - started:5.1f}s] producer {h.names[slot]} had exited with "
                          f"{victim.returncode}", flush=True)
                h.start_producer(slot, url, engine)
            time.sleep(0.1)
        trained_at = time.monotonic() - started
        # Drain: no more kills; give the poison prompts time to reach the dead-letter stream.
        drain_deadline = time.monotonic() + args.drain
        while time.monotonic() < drain_deadline:
            if len(asyncio.run(snapshot(url))["dead"]) >= args.poison:
                break
            time.sleep(0.5)
        # A producer restarted a moment ago may still be importing: SIGTERM before its handler
        # is installed kills it (holding nothing). Wait until all run, so the drain is real.
        running_deadline = time.monotonic() + 30
        while time.monotonic() < running_deadline and not asyncio.run(
            all_running(url, {h.names[s]: c.pid for s, c in h.producers.items()})
        ):
            time.sleep(0.2)
        for child in h.producers.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        exits = {h.names[s]: c.wait(30) for s, c in h.producers.items()}
        snap = asyncio.run(snapshot(url))
    finally:
        h.stop_all()
        server.close()
    return report(h, snap, fed_total, exits, time.monotonic() - started, trained_at, work)


def report(h: Harness, snap: dict[str, Any], fed_total: int, exits: dict[str, int], elapsed: float,
           trained_at: float, work: Path) -> int:
    records = h.records()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_id.setdefault(r["id"], []).append(r)
    repeated = {bid: rs for bid, rs in by_id.items() if len(rs) > 1}
    problems: list[str] = []
    # The only batch allowed twice: the one taken before the trainer's kill, redelivered unchanged.
    for bid, rs in repeated.items():
        same = all(r["indexes"] == rs[0]["indexes"] for r in rs)
        if not (same and len(rs) == 2 and rs[1]["redelivered"] and h.kills["trainer"] == 1):
            problems.append(f"batch {bid} recorded {len(rs)} times: {rs}")
    committed = Counter(i for rs in by_id.values() for i in rs[0]["indexes"])
    places: Counter[int] = Counter(committed)
    dead = dict(snap["dead"])
    places.update(i for i, _ in snap["dead"])
    places.update(snap["groups"])
    places.update(snap["prompts"])
    state = snap["state"]
    fed = int(state.get("fed", 0))
    if fed != fed_total:
        problems.append(f"fed {fed}, expected {fed_total}")
    lost = [i for i in range(fed) if places[i] == 0]
    duplicated = {i: c for i, c in places.items() if c > 1}
    strays = [i for i in places if not 0 <= i < fed]
    if snap["pending_prompts"]:
        problems.append(f"{snap['pending_prompts']} prompts still pending after every producer drained")
    bad_exits = {name: code for name, code in exits.items() if code != 0}
    if bad_exits:
        problems.append(f"producers exited non-zero on SIGTERM: {bad_exits}")
    recycled = sum(int(state.get(k, 0)) for k in ("recycled_failed", "recycled_aborted", "recycled_stale",
                                                  "recycled_filtered"))
    figures = [
        ("kills survived", f"{h.kills['producer']} producer SIGKILLs, {h.kills['trainer']} trainer SIGKILL, "
                           f"{h.kills['redis']} Redis SIGKILL+restart"),
        ("prompts fed", f"{fed} ({fed - len(dead)} ordinary, {len(dead)} dead-lettered)"),
        ("batches committed", f"{len(by_id)} ({len(repeated)} redelivered after the trainer kill, same id)"),
        ("groups committed", f"{sum(committed.values())}"),
        ("published not trained", f"{len(snap['groups'])} (in the groups stream)"),
        ("queued / returned", f"{len(snap['prompts'])} (in the prompts stream, none pending)"),
        ("dead-lettered", f"{len(dead)}: " + "; ".join(sorted({r.split(';')[0] for r in dead.values()}))[:200]),
        ("lost", f"{len(lost)}" + (f" {lost[:20]}" if lost else "")),
        ("duplicated", f"{len(duplicated)}" + (f" {dict(list(duplicated.items())[:20])}" if duplicated else "")),
        ("recycled", f"{recycled}"),
        ("reclaimed (XAUTOCLAIM/adopted)", state.get("reclaimed", "0")),
        ("duplicates discarded by PUBLISH", state.get("duplicates_discarded", "0")),
        ("returned on drain", state.get("returned", "0")),
        ("published / committed counters", f"{state.get('published', '0')} / {state.get('committed', '0')}"),
        ("time", f"{elapsed:.1f} s ({trained_at:.1f} s to the last step)"),
    ]
    width = max(len(k) for k, _ in figures)
    print("\nchaos run: " + str(work))
    for key, value in figures:
        print(f"  {key:<{width}}  {value}")
    if strays:
        problems.append(f"indexes outside 0..{fed - 1}: {strays[:20]}")
    if lost or duplicated or problems:
        for p in problems:
            print("  PROBLEM: " + p)
        print("RESULT: FAIL")
        return 1
    print("RESULT: OK (lost 0, duplicated 0)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kill-every", type=float, default=2.5, help="seconds between producer SIGKILLs")
    p.add_argument("--trainer-kill-at", type=int, default=3, help="the step whose batch the trainer dies holding")
    p.add_argument("--lease", type=float, default=2.0)
    p.add_argument("--max-attempts", type=int, default=2)
    p.add_argument("--poison", type=int, default=3, help="prompts the engine refuses (end dead-lettered)")
    p.add_argument("--mean-tokens", type=int, default=48)
    p.add_argument("--latency-per-token", type=float, default=0.01)
    p.add_argument("--drain", type=float, default=60.0, help="seconds to wait for the poison prompts to die")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="work directory (logs, AOF, trainer.jsonl); default: a temp dir")
    # The trainer subprocess.
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis", help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    p.add_argument("--hang-at", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--flag", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trainer:
        asyncio.run(trainer_main(args.redis, args.steps, args.batch_size, Path(args.record), args.hang_at,
                                 Path(args.flag)))
        return 0
    if args.trainer_kill_at >= args.steps:
        p.error("--trainer-kill-at must be below --steps")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
