"""Options shared by every command (logging, Redis URL and namespace); kept apart from
``main`` so command modules can use them without importing ``main`` back."""

from __future__ import annotations

import argparse
import os

REDIS_URL_ENV = "ROLLSTREAM_REDIS_URL"
FALLBACK_URL = "redis://127.0.0.1:6379/0"
REDIS_HELP = f"Redis URL (default ${REDIS_URL_ENV}, else {FALLBACK_URL})"


def default_redis_url() -> str:
    """``$ROLLSTREAM_REDIS_URL`` when set and non-empty, else the local default."""
    return os.environ.get(REDIS_URL_ENV) or FALLBACK_URL


def add_redis_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", default=default_redis_url(), metavar="URL", help=REDIS_HELP)


def common_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parent.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    return parent


def redis_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    add_redis_url(parent)
    parent.add_argument("--ns", required=True, metavar="NAME", help="pipeline namespace")
    return parent
