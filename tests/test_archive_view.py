"""``rollstream archive view``: the static page of an archive, checked in a real headless Chromium
(selenium + Debian's chromium-driver, installed by .ci/run): it loads with no console error,
its filters work, and a group opens with its samples, turns and history."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import group_fields
from rollstream.common.connection import connect
from rollstream.common.errors import ArchiveUnusable
from rollstream.common.keys import TRAINER_GROUP, Keys, StateField
from rollstream.common.protocol import GroupQueue
from rollstream.ops.archive_view import page_records
from rollstream.ops.archiver import Archiver, ArchiveSettings
from rollstream.testing.samples import full_group

pytest.importorskip("pyarrow")


def _group(index: int, source: str, *, tool_turn: bool) -> Any:
    group = full_group(n=2, index=index, seed=index)
    group = replace(group, source=source, history=["aborted"] if index % 3 == 0 else [])
    samples = []
    for s in group.samples:
        n = s.response_length
        mask = [1, 1, 0, 0, 1][:n] + [1] * max(0, n - 5) if tool_turn else [1] * n
        samples.append(replace(
            s, response=f"<b>answer {index}</b> <script>alert(1)</script>", loss_mask=mask,
            reward=float(index % 4) / 4, routed_experts=None,
        ))
    return replace(group, samples=samples)


async def _write_archive(redis: Redis, redis_url: str, ns: str, out: Path, expected: int, batch: int = 512) -> None:
    """Run a real archiver until ``expected`` records are archived into ``out``."""
    keys = Keys(ns)
    blocking = connect(redis_url, block_ms=1000)
    archiver = Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=out, flush_seconds=0.05, batch=batch))
    task = asyncio.create_task(archiver.run())
    try:
        async def drained() -> bool:
            if task.done():
                task.result()
            archived = int(await redis.hget(keys.state, StateField.ARCHIVED) or 0)
            return await redis.xlen(keys.archive) == 0 and archived == expected
        await wait_until(drained, message="the archive written")
    finally:
        archiver.stop()
        await task
        await blocking.aclose()


async def _train(redis: Redis, ns: str, groups: list[Any], *, batch: int) -> None:
    """Publish ``groups`` and commit them in batches of ``batch`` (a namespace with an archive)."""
    keys = Keys(ns)
    await make_namespace(redis, ns, archive_bytes=500_000_000)
    ids = [await redis.xadd(keys.groups, group_fields(group)) for group in groups]
    await redis.xreadgroup(TRAINER_GROUP, "trainer-v", {keys.groups: ">"})
    queue = GroupQueue(redis, keys, "trainer-v")
    for at in range(0, len(ids), batch):
        await queue.commit(ids[at:at + batch])


async def _archive(redis: Redis, redis_url: str, ns: str, out: Path) -> dict[str, int]:
    """Fates of every kind into a real archive; the count of each fate."""
    keys = Keys(ns)
    await make_namespace(redis, ns, archive_bytes=100_000_000)
    ids = []
    for index in range(12):
        group = _group(index, "math" if index % 2 else "code", tool_turn=index % 2 == 0)
        ids.append(await redis.xadd(keys.groups, group_fields(group)))
    await redis.xreadgroup(TRAINER_GROUP, "trainer-v", {keys.groups: ">"})
    queue = GroupQueue(redis, keys, "trainer-v")
    await queue.commit(ids[0:4])
    await redis.hset(keys.state, StateField.WEIGHT_VERSION, 1)
    await queue.commit(ids[4:8])
    for entry in ids[8:10]:
        await queue.drop_filtered(entry, "zero_std")
    await queue.recycle(ids[10], StateField.RECYCLED_STALE, {"index": 10, "attempt": 1}, "stale: 2 > 1")
    await queue.dead_letter(ids[11], {"index": 11}, "wrong_group_size: 1 != 2")
    blocking = connect(redis_url, block_ms=1000)
    archiver = Archiver(redis, blocking, ArchiveSettings(namespace=ns, out=out, flush_seconds=0.05))
    task = asyncio.create_task(archiver.run())
    try:
        async def drained() -> bool:
            if task.done():
                task.result()
            return await redis.xlen(keys.archive) == 0 and await redis.hget(keys.state, StateField.ARCHIVED) == b"12"
        await wait_until(drained, message="the archive written")
    finally:
        archiver.stop()
        await task
        await blocking.aclose()
    return {"trained": 8, "filtered": 2, "recycled": 1, "dead_lettered": 1}


@pytest.fixture
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    driver_path = shutil.which("chromedriver")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if driver_path is None or binary is None:
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them as root)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_page_records_shape(tmp_path: Path) -> None:
    assert page_records(tmp_path, 10) == []  # an empty archive is an empty page, not an error


async def test_the_page_in_a_headless_browser(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    counts = await _archive(redis, redis_url, ns, tmp_path / "arch")
    page = tmp_path / "arch" / "index.html"
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "rollstream.cli", "archive", "view", str(tmp_path / "arch")],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "<script>alert(1)</script>" not in page.read_text()  # the data is escaped JSON, never markup

    browser.get(page.as_uri())
    rows = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
    assert len(rows) == 12
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []

    fate = Select(browser.find_element(By.ID, "f-fate"))
    for name, count in counts.items():
        fate.select_by_visible_text(name)
        shown = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
        assert len(shown) == count, name
        assert {r.find_elements(By.TAG_NAME, "td")[1].text for r in shown} == {name}
    fate.select_by_visible_text("all")
    Select(browser.find_element(By.ID, "f-source")).select_by_visible_text("math")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rows tr")) == 6
    Select(browser.find_element(By.ID, "f-source")).select_by_visible_text("all")
    browser.find_element(By.ID, "f-rmin").send_keys("0.7")
    high = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
    assert len(high) == 3 and all(float(r.find_elements(By.TAG_NAME, "td")[6].text) >= 0.7 for r in high)
    browser.find_element(By.ID, "f-rmin").clear()
    browser.find_element(By.ID, "f-vmin").send_keys("1")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rows tr")) == 12  # the samples ran at versions 3-4
    browser.find_element(By.ID, "f-vmin").clear()
    browser.find_element(By.ID, "f-vmax").send_keys("2")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rows tr")) == 0
    browser.find_element(By.ID, "f-vmax").clear()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rows tr")) == 12

    # a trained group of index 0 (a tool turn, a history line) opens with every sample
    browser.find_elements(By.CSS_SELECTOR, "#rows tr")[0].click()
    detail = browser.find_element(By.ID, "detail")
    assert "group 0 (trained)" in detail.text
    samples = detail.find_elements(By.CSS_SELECTOR, ".sample")
    assert len(samples) == 2
    assert "<b>answer 0</b> <script>alert(1)</script>" in samples[0].text  # shown as text, not run
    turns = [t.text for t in samples[0].find_elements(By.CSS_SELECTOR, ".turn")]
    assert turns == ["model, trained: 2 tokens", "tool / not trained: 2 tokens", "model, trained: 1 tokens"]
    assert "aborted" in detail.text and "what is it?" in detail.text
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []
    if shot := os.environ.get("ROLLSTREAM_ARCHIVE_SCREENSHOT"):  # docs/img/archive_view.png is made so
        browser.execute_script("document.getElementById('list').scrollLeft = 0")
        browser.save_screenshot(shot)


def _view(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "archive", "view", *args],
        capture_output=True, text=True, check=False, timeout=120,
    )


async def test_a_folder_name_and_hostile_text_stay_text_in_a_browser(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, browser: Any
) -> None:
    """Issue 49 finding 6: a folder named ``run__DATA__`` (the valid namespace of the documented
    ``--out /data/archive/NAME``) stays the title; a response holding ``<!--<script>`` or a handler
    neither hides the app's script nor runs; a long response is cut on the page."""
    from selenium.webdriver.common.by import By

    hostile = '<!--<script> <img src=x onerror="window.pwned = 1"> </script><script>window.pwned = 2</script> & >'
    groups = []
    for index in range(3):
        group = _group(index, "math", tool_turn=False)
        samples = [replace(s, response=hostile + (" long" * 20_000 if index == 1 else "")) for s in group.samples]
        groups.append(replace(group, samples=samples))
    await _train(redis, ns, groups, batch=3)
    out = tmp_path / "run__DATA__"
    await _write_archive(redis, redis_url, ns, out, expected=3)
    done = await asyncio.to_thread(_view, str(out))
    assert done.returncode == 0, done.stderr
    page = (out / "index.html").read_text()
    assert "<!--" not in page.split('id="data">')[1] and "<img" not in page.split('id="data">')[1]
    assert len(page) < 200_000  # a 100,000-character response is cut (2,000 shown)

    browser.get((out / "index.html").as_uri())
    assert browser.find_element(By.TAG_NAME, "h1").text == "rollstream archive: run__DATA__"
    assert browser.title == "rollstream archive: run__DATA__"
    rows = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
    assert len(rows) == 3
    assert browser.find_element(By.ID, "count").text == "3 of 3 groups"
    assert browser.execute_script("return window.pwned === undefined") is True
    rows[1].click()
    text = browser.find_element(By.ID, "detail").find_elements(By.CSS_SELECTOR, ".sample")[0].text
    assert hostile in text and "more characters, in the archive" in text
    assert browser.execute_script("return window.pwned === undefined") is True
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


async def test_an_infinite_reward_shows_as_inf(redis: Redis, redis_url: str, ns: str, tmp_path: Path,
                                               browser: Any) -> None:
    """Issue 49 finding 17: a sample reward of inf (so a mean of inf) is shown, not a crash of
    ``archive view`` (``allow_nan=False``)."""
    from selenium.webdriver.common.by import By

    group = _group(1, "math", tool_turn=False)
    group = replace(group, samples=[replace(group.samples[0], reward=float("inf")), *group.samples[1:]])
    await _train(redis, ns, [group], batch=1)
    out = tmp_path / "arch"
    await _write_archive(redis, redis_url, ns, out, expected=1)
    done = await asyncio.to_thread(_view, str(out))
    assert done.returncode == 0, done.stderr
    browser.get((out / "index.html").as_uri())
    [row] = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
    assert row.find_elements(By.TAG_NAME, "td")[6].text == "inf"
    row.click()
    detail = browser.find_element(By.ID, "detail").text
    assert "mean reward: inf" in detail and "sample 0: reward inf" in detail
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


def _corrupt_column(path: Path, column: str) -> None:
    """Overwrite the bytes of one column chunk of a Parquet file (its footer stays readable)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    group = meta.row_group(0)
    [chunk] = [group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == column]
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(b"\xff" * chunk.total_compressed_size)


async def test_view_reads_only_the_newest_files_and_its_columns(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path
) -> None:
    """Issue 49 finding 14: ``view --limit 1`` reads the newest file only, and the page reads no
    ``data`` column: an older file whose rows are damaged, and a newest file whose payloads are,
    do not stop it. Asking for the older rows names the damaged file (finding 16)."""
    from rollstream.common.archive_schema import archive_files, read_table

    await _train(redis, ns, [_group(i, "math", tool_turn=False) for i in range(6)], batch=2)
    out = tmp_path / "arch"
    await _write_archive(redis, redis_url, ns, out, expected=6, batch=2)
    files = archive_files(out)
    assert len(files) == 3
    _corrupt_column(files[0], "fate")
    _corrupt_column(files[-1], "data")
    done = await asyncio.to_thread(_view, str(out), "--limit", "1")
    assert done.returncode == 0, done.stderr
    assert "rows" not in done.stderr and '"index": 5' in (out / "index.html").read_text()
    assert len(read_table(out, ["archive_id", "index"])) == 6  # no damaged column read
    with pytest.raises(ArchiveUnusable, match=str(files[0])):
        read_table(out, ["archive_id", "fate"])

    done = await asyncio.to_thread(_view, str(out), "--limit", "100")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(files[0]) in done.stderr and "restore it" in done.stderr


async def test_view_errors_name_the_fix(redis: Redis, redis_url: str, ns: str, tmp_path: Path) -> None:
    """Issue 49 finding 16: ``--html`` into a missing folder, or a part file that is not Parquet,
    is one line naming the path and the fix, not a traceback."""
    from rollstream.common.archive_schema import archive_files

    await _train(redis, ns, [_group(i, "math", tool_turn=False) for i in range(2)], batch=2)
    out = tmp_path / "arch"
    await _write_archive(redis, redis_url, ns, out, expected=2)
    done = await asyncio.to_thread(_view, str(out), "--html", str(tmp_path / "nowhere" / "page.html"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"mkdir -p {tmp_path / 'nowhere'}" in done.stderr
    [path] = archive_files(out)
    path.write_bytes(path.read_bytes()[:100])  # cut short, as by a full disk without fsync
    done = await asyncio.to_thread(_view, str(out))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(path) in done.stderr and "restore it" in done.stderr
