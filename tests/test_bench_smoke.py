"""Smoke test: every benchmark's entry point runs with tiny sizes and produces its table rows."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the repository root
# Quick runs write their tables and plots to a temporary directory, not over the committed ones.
os.environ.setdefault("ROLLSTREAM_BENCH_OUT", tempfile.mkdtemp(prefix="rollstream-bench-smoke-"))
bench_main = pytest.importorskip("bench.__main__")


def test_codec_quick_produces_rows() -> None:
    (table,) = bench_main.run(["codec"], quick=True)
    assert table.name == "codec"
    assert len(table.rows) == 2
    assert "rollstream µs" in table.markdown()


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
@pytest.mark.timeout(60)
def test_throughput_quick_produces_rows() -> None:
    (table,) = bench_main.run(["throughput"], quick=True)
    assert [row[0] for row in table.rows] == [1, 1, 2, 2, "in-process (1 proc)"]
    assert [row[1] for row in table.rows[:2]] == ["fake (HTTP + JSON)", "none"]
    assert all(isinstance(row[2], float) and row[2] > 0 for row in table.rows)


@pytest.mark.timeout(60)
def test_take_quick_produces_rows() -> None:
    table, per_call = bench_main.run(["take"], quick=True)
    assert table.name == "take"
    assert [row[1] for row in table.rows[:3]] == ["raw", "raw+decode", "take"]
    assert all(row[2] > 0 and row[5] > 0 for row in table.rows)
    assert [(row[0], row[1]) for row in per_call.rows] == [(1, 10), (4, 10)]
    for row in per_call.rows:
        assert 0 < row[2] <= row[3] and 0 < row[4] <= row[5]  # median <= p90, both measured
        assert row[7] == pytest.approx(row[2] / row[4]) and row[10] == pytest.approx(row[8] / row[9])


@pytest.mark.timeout(60)
def test_path_quick_traces_one_prompt_from_admission_to_publish() -> None:
    (table,) = bench_main.run(["path"], quick=True)
    admission, generate, at_write = table.rows
    assert admission[1] > generate[1] > 0  # the whole path enters more files than the request alone
    assert at_write[3] > generate[3] > 0  # the request's stack continues the prompt's (tasks followed)
    assert admission[3] > admission[2] > 0  # the prompt crosses tasks: its chain is deeper than one task


@pytest.mark.timeout(180)
def test_r3_quick_produces_rows() -> None:
    codec, take, redis_table = bench_main.run(["r3"], quick=True)
    assert [row[1] for row in codec.rows] == ["no R3", "R3 uint8", "R3 as int32"]
    uint8, int32 = codec.rows[1][3], codec.rows[2][3]
    assert 3.5 < int32 / uint8 < 4.1  # the replay dominates: 4 bytes an id vs 1
    assert [row[1] for row in take.rows] == ["raw", "raw+decode", "take"]
    filled = redis_table.rows[1]
    assert filled[1] == "filled until OOM" and filled[5] > 0


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
@pytest.mark.timeout(120)
def test_episodes_quick_produces_rows() -> None:
    table, session = bench_main.run(["episodes"], quick=True)
    assert all(row[1] > 0 for row in session.rows) and len(session.rows) == 2
    assert [row[0] for row in table.rows] == [
        "single-turn (default plug-in)", "3 turns, tool instant", "3 turns, tool sleeps 0.2 s",
    ]
    # quick windows are too short for CPU figures (psutil's clock ticks): only the rates must be there
    assert all(row[1] > 0 and row[2] > 0 for row in table.rows)


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
@pytest.mark.timeout(120)
def test_durable_quick_resumes_with_only_the_calls_in_flight_made_again() -> None:
    kill, limit, cost, sweep = bench_main.run(["durable"], quick=True)
    assert limit.rows[0][3] <= 3 and limit.rows[0][2] == 16  # 4 producers, a limit of 3: never more than 3 holders
    rows = {row[0]: row for row in kill.rows}
    resumed, start_over = rows["kill A at half, durable (resume)"], rows["kill A at half, start over"]
    # engine calls made again: the calls in flight at the kill (a reply received but not yet
    # journaled when the SIGKILL lands counts as made again: a window of one round trip)
    assert resumed[4] <= resumed[5] + 2 and resumed[4] < start_over[4]
    assert all(row[8].split("/")[0] == row[8].split("/")[1] for row in kill.rows)  # token for token equal
    assert all(row[9] == 0 for row in kill.rows)  # every journal removed
    assert len(cost.rows) == 5
    assert [row[2] for row in sweep.rows] == ["100"] * 2  # every orphan swept, the live journals kept


@pytest.mark.timeout(120)
def test_adapters_quick_produces_rows() -> None:
    (table,) = bench_main.run(["adapters"], quick=True)
    assert [row[0] for row in table.rows] == ["episode", "slime", "openai"]
    assert all(row[1] == table.rows[0][1] and row[2] > 0 for row in table.rows)  # the same calls, measured


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
@pytest.mark.timeout(180)
def test_restart_quick_measures_both_producers() -> None:
    (table,) = bench_main.run(["restart"], quick=True)
    assert table.name == "restart"
    ((pair, first, second, ratio, first_life, second_life, life_ratio),) = table.rows
    assert pair == 1 and first > 0 and second > 0 and ratio == pytest.approx(second / first)
    assert first_life > 0 and second_life > 0 and life_ratio == pytest.approx(second_life / first_life)


@pytest.mark.timeout(60)
def test_reply_bound_quick_produces_rows() -> None:
    (table,) = bench_main.run(["reply_bound"], quick=True)
    assert table.name == "reply_bound" and len(table.rows) == 4
    assert all(row[5] > 1 for row in table.rows)  # every legitimate reply under its bound


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_flag_quick_produces_rows() -> None:
    (table,) = bench_main.run(["one_flag"], quick=True)
    assert table.name == "one_flag" and len(table.rows) == 4
    assert all(row[1] > 0 for row in table.rows)


@pytest.mark.timeout(120)
def test_diagnose_quick_produces_rows() -> None:
    (table,) = bench_main.run(["diagnose"], quick=True)
    assert table.name == "diagnose"
    assert [(row[1], row[3]) for row in table.rows] == [(7, 1), (7, 1)]
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in table.rows)


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
def test_fleet_quick_measures_the_sick_fleet_the_old_engine_the_cache_and_adaptive_concurrency() -> None:
    from bench import fleet

    sick, behind, cache, adaptive = fleet.run(quick=True)
    assert [row[2] for row in sick.rows] == [row[1] for row in sick.rows]  # every group completed
    assert behind.rows[1][2] <= behind.rows[0][2]  # the version gate wastes no more than before
    assert all(0 <= row[2] <= 1 for row in cache.rows)
    assert all(row[1] > 0 for row in adaptive.rows) and adaptive.rows[-1][0].startswith("adaptive")


def test_joining_quick_keeps_the_sick_engines_out_and_completes_every_group() -> None:
    from bench import joining

    (table,) = joining.run(quick=True)
    assert [row[2] for row in table.rows] == [row[1] for row in table.rows]  # every group completed
    assert table.rows[1][4] == "joining, joining" and table.rows[2][4] != "joining, joining"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_loop_stall_quick_produces_rows() -> None:
    table, costs = bench_main.run(["loop_stall"], quick=True)
    (row,) = table.rows
    assert row[1] == "12/12" and row[2] == 0  # every group trained once
    assert row[6] >= 2 and row[7] >= 2  # the 2 stalls logged and in the heartbeats
    assert [r[0] for r in costs.rows] == ["redis-py's (asyncio.timeout)", "stall-tolerant (ReplyDeadline)"]
    assert all(r[1] > 0 and r[2] > 0 for r in costs.rows)  # both measured


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
@pytest.mark.timeout(240)
def test_learning_sim_quick_times_sync_and_async_against_the_bound() -> None:
    (table,) = bench_main.run(["learning_sim"], quick=True)
    assert table.name == "learning_sim"
    modes = ["sync", "async, partial rollout off", "async, partial rollout on"]
    assert [(row[0], row[1]) for row in table.rows] == [(c, m) for c in ("trainer-bound", "engine-bound") for m in modes]
    for case in range(2):
        sync, *overlapped = table.rows[3 * case : 3 * case + 3]
        assert sync[2] > 0 and sync[3] > 0 and sync[4] > 0  # s/step, G, T measured
        for row in overlapped:
            bound, speedup, fraction = row[6], row[7], row[8]
            assert bound > 1 and speedup > 0
            assert fraction == pytest.approx(speedup / bound)


@pytest.mark.slow  # a scenario of seconds to minutes (issue 50: the default suite under ten minutes)
@pytest.mark.timeout(240)
def test_staleness_rule_quick_compares_partial_rollout_and_the_two_rules() -> None:
    (table,) = bench_main.run(["staleness_rule"], quick=True)
    assert table.name == "staleness_rule"
    assert [row[0] for row in table.rows] == [
        "partial rollout off", "partial on, oldest_token (strict)", "partial on, newest_token (chosen)",
    ]
    for row in table.rows:
        assert row[1] > 0 and row[2] >= 1  # s/step; every trained token was generated
        assert row[9] <= 1  # the rule's staleness within max_staleness
    assert table.rows[1][3] == table.rows[2][3] == 0  # partial rollout: nothing recycled for an abort


@pytest.mark.timeout(180)
def test_archive_quick_produces_rows() -> None:
    pytest.importorskip("pyarrow")
    take, archiver, memory, evaluation = bench_main.run(["archive"], quick=True)
    assert [row[0] for row in take.rows] == ["off", "on, no archiver", "on, archiver running"]
    assert all(row[1] > 0 for row in take.rows)
    assert archiver.rows[0][0] > 0
    held, bounded = memory.rows
    assert held[5] == 0 and bounded[5] > 0  # the small budget dropped records, counted
    assert [row[0][:5] for row in evaluation.rows] == ["no ev", "eval ", "block"]
    assert evaluation.rows[1][1] >= 1 and evaluation.rows[1][3] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bias_quick_produces_rows() -> None:
    """Issue 38's scenario, 40 prompts: both runs train every prompt (the weight updates' aborts
    keep the attempt: nothing is dead-lettered)."""
    _cost, table = bench_main.run(["bias"], quick=True)
    assert [row[0] for row in table.rows] == ["partial-off", "partial-on"]
    assert all(row[2] == "0 / 0" and row[3] == "8 / 8" for row in table.rows), table.rows


@pytest.mark.timeout(120)
def test_mooncake_store_quick_measures_every_path() -> None:
    (table,) = bench_main.run(["mooncake_store"], quick=True)
    if table.headers == ["why"]:
        pytest.skip(f"Mooncake cannot run here: {table.rows[0][0]}")
    assert [row[0] for row in table.rows][:2] == ["MooncakeStore", "MooncakeStore"]
    assert all(row[3] > 0 for row in table.rows)


def test_eval_submit_quick_writes_every_prompt_once() -> None:
    from bench import eval_submit

    [table] = eval_submit.run(quick=True)
    [row] = table.rows
    assert row[0] == "this tree" and row[1] == row[2] == 20_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_payload_quick_puts_the_arrays_beside_redis_and_splits_them_by_rank() -> None:
    """Issue 48 item 4's run, tiny: the before table, then inline against the stores that can run
    here. Inline, Redis holds every byte of the group; with a store, only what stays in the entry
    (the control fields, one spec per array and the refs: ~4 KB, 0.005 % of a 16 x 8k R3 group; the
    target is 1 %); each of 4 ranks reads its own shard's
    objects (8 groups of unequal sizes, balanced by tokens: 0.238-0.254 of the store bytes)."""
    before, table, projection = bench_main.run(["payload"], quick=True)
    assert [row[0] for row in before.rows] == ["16 x 1k"] and all(v > 0 for v in before.rows[0][1:4])
    column = {name: i for i, name in enumerate(table.headers)}
    rows = {row[0]: row for row in table.rows}
    assert {"inline", "inline, no R3", "inline, 8 x 1k, no R3", "fs"} <= rows.keys()
    held = column["held / payload"]
    assert rows["inline"][held] > 0.9  # inline: Redis keeps every byte
    for name in ("fs", "mooncake"):
        if name in rows:
            assert rows[name][held] < 0.01  # issue 48's target
            low, high = (float(x) for x in rows[name][column["store bytes per rank of 4"]].split("-"))
            assert 0.2 < low <= 0.25 <= high < 0.3
    assert all(row[column["groups/s end to end"]] > 0 for row in table.rows)
    # the large run with R3: inline it needs more than one Redis core, with a store a fraction of one
    share = {row[0]: float(row[3].rstrip("%")) / 100 for row in projection.rows}
    assert share["inline"] > 1 and 0 < share["fs"] < 1
