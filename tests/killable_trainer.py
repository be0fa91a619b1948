"""A trainer process a test kills between ``take()`` and ``commit()``:
``python killable_trainer.py URL NS TARGET MODE [--rows]``.

It takes a batch of TARGET groups and prints one JSON line (the batch id, its indexes, whether it
was redelivered; with ``--rows`` also each sample's routed-expert rows summed, which fetches the
arrays from the payload store, checked by size), then commits it (MODE ``commit``) or hangs
until it is killed (MODE ``hang``). :func:`run_trainer` starts it and reads that line.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any


def run_trainer(url: str, ns: str, mode: str, *, target: int = 2,
                rows: bool = False) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start the trainer; return it and what it printed once it took its batch."""
    argv = [sys.executable, __file__, url, ns, str(target), mode, *(["--rows"] if rows else [])]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.wait(10)
        raise AssertionError(f"trainer exited with {child.returncode} before taking a batch")
    return child, json.loads(line)


async def main(argv: list[str]) -> None:
    from rollstream.consumer import GroupConsumer

    url, ns, target, mode = argv[:4]
    rows = "--rows" in argv[4:]
    consumer = await GroupConsumer.connect(url, ns, "trainer-k", **({"payload_check": "size"} if rows else {}))
    batch = await consumer.take(int(target))
    taken: dict[str, Any] = {"id": batch.id, "indexes": [g.index for g in batch.groups],
                             "redelivered": batch.redelivered}
    if rows:
        taken["rows"] = [int(v.sum()) for v in batch.routed_experts_numpy()]  # fetched on first access
    print(json.dumps(taken), flush=True)
    if mode == "hang":
        await asyncio.sleep(3600)
    await consumer.commit(batch)
    await consumer.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
