"""Child process of ``bench.take``: one measurement with one redis-py reply parser.

``BENCH_HIDE_HIREDIS=1`` hides the hiredis package before redis-py is imported (redis-py picks
its parser at import time), so the same interpreter measures the pure-Python parser. Prints the
result as one JSON line.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("BENCH_HIDE_HIREDIS"):
    sys.modules["hiredis"] = None  # type: ignore[assignment]  # makes `import hiredis` fail

import asyncio
import json

from redis.utils import HIREDIS_AVAILABLE

from bench.take import measure


def main() -> None:
    groups, tokens, repeat = (int(a) for a in sys.argv[1:4])
    r3 = len(sys.argv) > 4 and sys.argv[4] == "r3"
    result = asyncio.run(measure(groups, tokens, repeat, r3))
    result["parser"] = "hiredis" if HIREDIS_AVAILABLE else "python"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
