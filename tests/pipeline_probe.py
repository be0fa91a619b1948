"""Run as a separate process (e.g. inside a network namespace with ``ip netns exec``):

* ``trainer URL NS COUNT BATCH OUT``: take and commit ``COUNT`` groups in batches of ``BATCH``
  and write what was taken (index, attempt, producer, when) to the JSON file ``OUT``;
* ``snapshot URL NS``: print the namespace's counters, stream lengths and pending entries as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.consumer import GroupConsumer


async def trainer(url: str, ns: str, count: int, batch: int) -> dict[str, Any]:
    taken: list[dict[str, Any]] = []
    batches: list[float] = []
    started = time.time()
    async with await GroupConsumer.connect(url, ns, "netns-trainer", stall_timeout=300) as consumer:
        while len(taken) < count:
            got = await consumer.take(min(batch, count - len(taken)))
            taken += [{"index": g.index, "attempt": g.attempt, "producer": g.producer} for g in got.groups]
            await consumer.commit(got)
            batches.append(time.time())
    return {"started": started, "taken": taken, "batches": batches}


async def snapshot(url: str, ns: str) -> dict[str, Any]:
    keys = Keys(ns)
    redis = connect(url)
    try:
        state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
        pending: dict[str, int] = {}
        for group, stream in ((PRODUCERS_GROUP, keys.prompts), (TRAINER_GROUP, keys.groups)):
            for row in await redis.xpending_range(stream, group, min="-", max="+", count=10000):
                name = row["consumer"].decode()
                pending[f"{group}/{name}"] = pending.get(f"{group}/{name}", 0) + 1
        return {
            "state": state,
            "prompts": await redis.xlen(keys.prompts),
            "groups": await redis.xlen(keys.groups),
            "dead": await redis.xlen(keys.dead),
            "pending": pending,
        }
    finally:
        await redis.aclose()


def main(argv: list[str]) -> None:
    if argv[0] == "trainer":
        result = asyncio.run(trainer(argv[1], argv[2], int(argv[3]), int(argv[4])))
        with open(argv[5], "w") as handle:
            json.dump(result, handle)
    elif argv[0] == "snapshot":
        sys.stdout.write(json.dumps(asyncio.run(snapshot(argv[1], argv[2]))) + "\n")
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
