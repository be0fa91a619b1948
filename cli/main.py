"""The ``rollstream`` command line. Each command lives in its own module; this one wires them.

Every command takes ``--log-level`` and ``--log-json``; logging is configured here, never in
library code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from redis.exceptions import ConnectionError as RedisConnectionError
from rollstream import __version__
from rollstream.common.errors import ConfigError, RollstreamError
from rollstream.runtime.children import FATAL_FILE_ENV

from . import archive_commands, commands, demo, inspect, ops_commands, produce
from .shared_options import apply_redis_secrets, common_options, redis_options


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollstream",
        description="Fully-async rollout pipeline for LLM reinforcement learning on Redis Streams.",
    )
    parser.add_argument("--version", action="version", version=f"rollstream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    base = [common_options()]
    with_redis = [common_options(), redis_options()]
    for module in (commands, produce, demo, inspect, ops_commands, archive_commands):
        module.register(sub, base, with_redis)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    apply_redis_secrets(args)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    except RollstreamError as exc:  # an error of the tree: its message, no traceback
        if isinstance(exc, ConfigError):
            _record_fatal(exc)
        return _fail(exc)
    except RedisConnectionError as exc:
        return _fail(exc, prefix="cannot reach Redis: ")
    return int(code or 0)


def _record_fatal(exc: BaseException) -> None:
    """A supervised child (``$ROLLSTREAM_FATAL_FILE`` set by its supervisor) says why it stopped
    for good: a configuration error is not cured by a restart."""
    path = os.environ.get(FATAL_FILE_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(str(exc).partition("\n")[0] or type(exc).__name__, encoding="utf-8")


def _fail(exc: BaseException, prefix: str = "") -> int:
    """One line on stderr and exit code 2; the rest of a multi-line message (a remote traceback)
    goes to the DEBUG log."""
    first, _, rest = str(exc).partition("\n")
    sys.stderr.write(f"rollstream: error: {prefix}{first or type(exc).__name__}\n")
    if rest:
        logging.getLogger("rollstream.cli").debug("%s", rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
