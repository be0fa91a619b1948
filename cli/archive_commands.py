"""``rollstream archive``: the long-running archiver (every group's fate into Parquet) and
``rollstream archive view DIR`` (one static HTML page of an archive)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError

from .commands import run_with_signals
from .shared_options import add_redis_url

logger = logging.getLogger(__name__)


def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "archive", parents=base,
        help="write every group's fate (trained, filtered, recycled, dead-lettered) to Parquet, for ever",
    )
    add_redis_url(p)
    p.add_argument("--ns", default=None, metavar="NAME", help="pipeline namespace ")
    p.add_argument("--out", default=None, metavar="DIR", help="the archive folder ")
    p.add_argument("--partition", default="version", choices=["version", "hour"],
                   help="a folder per trainer version (default) or per UTC hour")
    p.add_argument("--keep-arrays", action="store_true",
                   help="keep the big per-token arrays (routing replay, teacher log-probs)")
    p.add_argument("--batch", type=int, default=512,
                   help="records per read and at most per file (default: %(default)s)")
    p.add_argument("--flush-seconds", type=float, default=5.0,
                   help="seconds within which records read are written (default: %(default)s)")
    p.add_argument("--lease-seconds", type=float, default=15.0,
                   help="one archiver per namespace: seconds its lease lasts, after which a killed "
                        "archiver's lapses (default: %(default)s)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="seconds to wait for another archiver's lease to go, then refuse (default: 0, refuse at once)")
    p.set_defaults(func=cmd_archive)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    v = actions.add_parser("view", parents=base, help="write one static HTML page to look at an archive's groups")
    v.add_argument("dir", metavar="DIR", help="an archive folder written by `rollstream archive`")
    v.add_argument("--html", default=None, metavar="PATH", help="the page to write (default DIR/index.html)")
    v.add_argument("--limit", type=int, default=5000, help="at most this many groups, the newest (default 5000)")
    v.set_defaults(func=cmd_view)


def cmd_archive(args: argparse.Namespace) -> int:
    from rollstream.ops.archiver import Archiver, ArchiveSettings

    if not args.ns or not args.out:
        raise ConfigError("rollstream archive needs --ns NAME and --out DIR (or the action `view DIR`)")
    settings = ArchiveSettings(
        namespace=args.ns, out=Path(args.out), partition=args.partition, keep_arrays=args.keep_arrays,
        batch=args.batch, flush_seconds=args.flush_seconds, lease_seconds=args.lease_seconds,
        wait_seconds=args.wait,
    )
    redis = connect(args.redis, name="rollstream-archiver")
    blocking = connect(args.redis, block_ms=1000, name="rollstream-archiver-read")
    archiver = Archiver(redis, blocking, settings)

    async def main() -> None:
        try:
            written = await archiver.run()
            logger.info("archiver (ns %s): stopped after %d records in %d files", args.ns, written, archiver.files)
        finally:
            await redis.aclose()
            await blocking.aclose()

    run_with_signals(main, archiver.stop)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from rollstream.ops.archive_view import write_page

    folder = Path(args.dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not an archive folder")
    if args.limit < 1:
        raise ConfigError(f"--limit must be positive, got {args.limit}")
    out = Path(args.html) if args.html else folder / "index.html"
    count = write_page(folder, out, args.limit)
    logger.info("wrote %s (%d groups)", out, count)
    return 0
