"""Another Redis client, in its own process, sending one small command every millisecond and
timing each (bench/payload.py: the worst latency another producer sees while big groups flow).

``python -m bench.payload_probe --port P --kind ping|xadd --out FILE`` runs until SIGTERM, then
writes ``[[start, seconds], ...]`` (``time.monotonic()`` of each send, system-wide on Linux, so
the parent can cut the records to its own windows) as JSON to ``FILE``. ``xadd`` adds a small
entry (a 4 KB ``data`` field, like a group of a few short samples) to ``probe:stream``, capped at
1,000 entries.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

import redis as redis_sync

INTERVAL = 0.001
SMALL = {"index": 0, "n": 8, "data": b"x" * 4096}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.payload_probe")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kind", choices=("ping", "xadd"), default="ping")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    client = redis_sync.Redis(port=args.port, socket_timeout=30)
    records: list[tuple[float, float]] = []
    if args.kind == "ping":

        def command() -> None:
            client.ping()
    else:

        def command() -> None:
            client.xadd("probe:stream", SMALL, maxlen=1000, approximate=True)

    command()  # connected before the first timed call
    args.out.with_suffix(".ready").touch()
    while not stop:
        started = time.monotonic()
        command()
        records.append((started, time.monotonic() - started))
        pause = started + INTERVAL - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    client.close()
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
