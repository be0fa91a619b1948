"""Options shared by every command (logging, Redis URL and namespace); kept apart from
``main`` so command modules can use them without importing ``main`` back."""

from __future__ import annotations

import argparse
import os

from rollstream.common.connection import PASSWORD_ENV, PASSWORD_FILE_ENV

REDIS_URL_ENV = "ROLLSTREAM_REDIS_URL"
FALLBACK_URL = "redis://127.0.0.1:6379/0"
REDIS_HELP = (
    f"Redis URL: redis://, rediss://, redis+sentinel://, redis+cluster:// (default ${REDIS_URL_ENV}, "
    f"else {FALLBACK_URL}); keep passwords out of it, use ${PASSWORD_ENV} or --redis-password-file"
)


def default_redis_url() -> str:
    """``$ROLLSTREAM_REDIS_URL`` when set and non-empty, else the local default."""
    return os.environ.get(REDIS_URL_ENV) or FALLBACK_URL


def add_redis_url(parser: argparse.ArgumentParser) -> None:
    """``--redis`` (default ``$ROLLSTREAM_REDIS_URL``) and ``--redis-password-file``."""
    parser.add_argument("--redis", default=default_redis_url(), metavar="URL", help=REDIS_HELP)
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


def common_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="the least severe log records written, to stderr (default: %(default)s)")
    parent.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    return parent


def redis_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    add_redis_url(parent)
    parent.add_argument("--ns", required=True, metavar="NAME", help="pipeline namespace")
    return parent
