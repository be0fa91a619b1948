"""Reading an archive (issue 49 finding 14): ``python -m bench archive_read``.

An archive of ``GROUPS`` trained groups of 8 samples (a 6,000-character response and 1,500
tokens with log-probs each, partly random text so zstd cannot shrink it away) is written as the
archiver writes it (``record_row`` + ``write_part``, 512 records a file). Each reader then runs
in a fresh Python process and reports its peak RSS (``VmHWM``): ``rollstream archive view
--limit 1``, the full page (``--limit 5000``), ``ArchiveReplay.open``, ``open`` then every step
taken, and ``read_table`` of two small columns. The same archive can be read by an older
rollstream: ``--python /path/to/old/.venv/bin/python`` (``ROLLSTREAM_BENCH_PYTHON``) runs the
readers with that interpreter, which is how the before/after pairs in docs/benchmarks.md were
measured. ``ROLLSTREAM_BENCH_ARCHIVE_GROUPS`` sets the number of groups (default 800).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.common import Table

GROUPS = 800
PER_FILE = 512

_READERS = {
    "archive view --limit 1": (
        "from rollstream.cli.main import main; main(['archive', 'view', ROOT, '--limit', '1', '--html', PAGE])"
    ),
    "archive view (all)": (
        "from rollstream.cli.main import main; main(['archive', 'view', ROOT, '--html', PAGE])"
    ),
    "ArchiveReplay.open": "from rollstream.consumer import ArchiveReplay; r = ArchiveReplay.open(ROOT)",
    "ArchiveReplay.open + take every step": (
        "from rollstream.consumer import ArchiveReplay; r = ArchiveReplay.open(ROOT)\n"
        "for s in list(r.steps): r.take_next(len(getattr(s, 'rows', None) or s.payloads))"
    ),
    "read_table(archive_id, fate)": (
        "from rollstream.common.archive_schema import read_table; t = read_table(ROOT, ['archive_id', 'fate'])"
    ),
}


def build(root: Path, groups: int) -> int:
    """Write the archive; its size in bytes."""
    from rollstream.common.archive_schema import BIG_ARRAYS, ArchiveRecord, part_metadata, record_row, write_part
    from rollstream.common.codec import group_fields
    from rollstream.testing.samples import full_group

    rng = random.Random(49)
    words = [f"w{rng.randrange(10**6)}" for _ in range(4000)]
    rows = []
    for index in range(groups):
        group = full_group(n=8, index=index, seed=index)
        samples = []
        for s in group.samples:
            text = " ".join(rng.choice(words) for _ in range(750))[:6000]
            tokens = [rng.randrange(150_000) for _ in range(1500)]
            samples.append(replace(
                s, response=text, tokens=tokens, prompt_length=6, response_length=len(tokens) - 6,
                loss_mask=[1] * (len(tokens) - 6), rollout_log_probs=[-rng.random() for _ in range(len(tokens) - 6)],
                **dict.fromkeys(BIG_ARRAYS),
            ))
        group = replace(group, samples=samples)
        fields = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in group_fields(group).items()}
        record = ArchiveRecord.parse(
            f"{1000 + index}-0",
            {b"fate": b"trained", b"kind": b"groups", b"step": str(index // 8 + 1).encode(),
             b"position": str(index % 8).encode(), b"actor": b"trainer", b"entry_id": f"{index + 1}-0".encode(),
             **fields},
        )
        rows.append(record_row(record))
    after = "0-0"
    for at in range(0, len(rows), PER_FILE):
        chunk = rows[at:at + PER_FILE]
        write_part(root, "version=0", chunk, part_metadata("bench", after))
        after = chunk[-1]["archive_id"]
    return sum(p.stat().st_size for p in root.rglob("*.parquet"))


def peak_rss_mb(python: str, code: str, root: Path) -> float:
    page = root.parent / "page.html"
    peak = "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    # VmHWM: this process's own peak (ru_maxrss would keep the forking parent's across exec)
    script = f"ROOT = {str(root)!r}\nPAGE = {str(page)!r}\n{code}\n{peak}"
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{code!r} failed: {done.stderr[-2000:]}")
    return int(done.stdout.strip().splitlines()[-1]) / 1024


def run(quick: bool = False) -> list[Table]:
    python = os.environ.get("ROLLSTREAM_BENCH_PYTHON", sys.executable)
    groups = 40 if quick else int(os.environ.get("ROLLSTREAM_BENCH_ARCHIVE_GROUPS", GROUPS))
    with tempfile.TemporaryDirectory(prefix="rollstream-archive-read-") as tmp:
        root = Path(tmp) / "archive"
        size = build(root, groups)
        base = peak_rss_mb(python, "import rollstream.consumer, rollstream.ops.archive_view", root)
        rows: list[list[object]] = [["python + rollstream imported", base, ""]]
        for name, code in _READERS.items():
            rss = peak_rss_mb(python, code, root)
            page = root.parent / "page.html"
            note = f"page {page.stat().st_size / 1e6:.1f} MB" if "view" in name and page.exists() else ""
            rows.append([name, rss, note])
            page.unlink(missing_ok=True)
    return [Table(
        name="archive_read", title=f"Reading an archive of {groups} groups ({size / 1e6:.0f} MB of Parquet): peak RSS",
        headers=["reader", "peak RSS (MB)", ""], rows=rows,
        notes=[f"readers run by {python}"], command="python -m bench archive_read",
    )]
