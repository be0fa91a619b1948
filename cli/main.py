"""The ``rollstream`` command line. Each command lives in its own module; this one wires them.

Every command takes ``--log-level`` and ``--log-json``; logging is configured here, never in
library code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from rollstream.common.connection import PASSWORD_ENV, PASSWORD_FILE_ENV

from . import commands, demo, inspect, ops

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV = "ROLLSTREAM_REDIS_URL"


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


def common_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parent.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    return parent


def add_redis_url(parser: argparse.ArgumentParser) -> None:
    """``--redis`` (default ``$ROLLSTREAM_REDIS_URL``) and ``--redis-password-file``."""
    parser.add_argument(
        "--redis", default=os.environ.get(URL_ENV) or DEFAULT_URL, metavar="URL",
        help=f"Redis URL: redis://, rediss://, redis+sentinel://, redis+cluster:// (default ${URL_ENV} or "
             f"{DEFAULT_URL}); keep passwords out of it, use ${PASSWORD_ENV} or --redis-password-file",
    )
    parser.add_argument(
        "--redis-password-file", default=None, metavar="PATH",
        help=f"read the Redis password from this file (sets ${PASSWORD_FILE_ENV} for child processes too)",
    )


def apply_redis_secrets(args: argparse.Namespace) -> None:
    """A password file given on the command line reaches ``connect()`` through the environment,
    so the secret itself never appears in any process's argument list."""
    path = getattr(args, "redis_password_file", None)
    if path:
        os.environ[PASSWORD_FILE_ENV] = path


def redis_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    add_redis_url(parent)
    parent.add_argument("--ns", required=True, metavar="NAME", help="pipeline namespace")
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollstream",
        description="Fully-async rollout pipeline for LLM reinforcement learning on Redis Streams.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    base = [common_options()]
    with_redis = [common_options(), redis_options()]
    for module in (commands, demo, inspect, ops):
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
    except ValueError as exc:  # config errors: a clear message, no traceback
        logging.getLogger("rollstream").error("%s", exc)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
