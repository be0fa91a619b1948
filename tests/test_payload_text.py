"""The response text on the payload plane, end to end on a real ``fs`` store with real producer
processes, the simulator and real Redis: the text leaves the entry with its sample's arrays, a
``keep`` filter that reads it (or the token values) runs again once its group is fetched, and an
unreadable object on that path recycles the group with the reason."""

from __future__ import annotations

import asyncio
import itertools
import json
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.arrays import Unfetched, UnfetchedText
from rollstream.common.codec import (
    OFFLOAD_VERSION,
    CodecLimits,
    StoreObject,
    decode_group,
    decode_prompt,
    encode_group,
    encode_group_offloaded,
    encode_prompt,
)
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import DecodeError, PayloadCorrupt, PayloadNotFetched
from rollstream.common.keys import Keys, StateField
from rollstream.common.models import Group, Sample, retry_prompt
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim.simulator import SimEngine
from test_payload_faults import MOE_FLAG, counter, nothing_left
from test_payload_pipeline import _xlen_is, moe_sim, objects_in, start

__all__ = ["moe_sim"]  # the fixture, imported for this module's tests


def reads_text(seen: dict[int, list[str]]):  # type: ignore[no-untyped-def]
    """A keep filter that reads every sample's text (rejects prompts 0 and 1)."""

    def keep(group: Group) -> bool | str:
        seen[group.index] = [s.response.upper() for s in group.samples]  # a str method: refused before the fetch
        return True if group.index >= 2 else "first"

    return keep


def reads_tokens(group: Group) -> bool | str:
    """A keep filter that reads token values (rejects prompts 0 and 1)."""
    return True if sum(group.samples[0].tokens) >= 0 and group.index >= 2 else "first"


@pytest.mark.parametrize("what", ["text", "tokens"])
async def test_a_keep_filter_reading_offloaded_values_runs_after_the_fetch(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path, what: str,
) -> None:
    store = tmp_path / "store"
    await start(redis, redis_url, ns, moe_sim, procs, store, 2)
    keys = Keys(ns)
    await wait_until(lambda: _xlen_is(redis, keys.groups, 2), 30, message="2 groups published")
    await add_prompts(redis, ns, 2, start=2)  # after them in the stream: the take reads all four
    await wait_until(lambda: _xlen_is(redis, keys.groups, 4), 30, message="4 groups published")
    for _, fields in await redis.xrange(keys.groups):  # the text left the entry with the arrays
        for wire in msgpack.unpackb(fields[b"data"])["samples"]:
            assert "resp" not in wire and "tok" not in wire
            _offset, nbytes, code, shape, chars = wire["ofl"][1]["resp"]
            assert code == "B" and shape == [nbytes] and 0 < chars <= nbytes
    seen: dict[int, list[str]] = {}
    keep = reads_text(seen) if what == "text" else reads_tokens
    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", payload_check="size") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(2, keep=keep)
        assert sorted(g.index for g in batch.groups) == [2, 3]
        assert not batch.unfetched  # the filter's fetch put everything in (checksums verified)
        for group in batch.groups:
            for s in group.samples:
                assert isinstance(s.response, str) and len(s.response) > 0
                assert s.response.encode() == bytes(t & 0xFF for t in s.tokens[s.prompt_length:])  # the sim's text
            if what == "text":
                assert seen[group.index] == [s.response.upper() for s in group.samples]
        assert batch.metrics["filtered/first"] == 2.0
        assert await consumer.commit(batch) == 2
    assert objects_in(store) == []  # the dropped groups' objects are freed too
    assert await counter(redis, ns, StateField.PAYLOAD_READ_FAILURES) == 0


async def test_an_unreadable_object_on_the_filters_fetch_recycles_its_group(
    redis: Redis, redis_url: str, ns: str, moe_sim: SimEngine, procs: ProcessPool, tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    await make_namespace(redis, ns, payload_store=f"fs://{store}", payload_min_bytes=1024)
    await add_prompts(redis, ns, 1)
    a = procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-a")
    keys = Keys(ns)
    await wait_until(lambda: _xlen_is(redis, keys.groups, 1), 30, message="the group is published")
    procs.stop_all()
    assert await asyncio.to_thread(a.wait, 20) == 0
    victim = objects_in(store)[0]
    (store / victim).unlink()
    await add_prompts(redis, ns, 1, start=1)
    procs.producer(redis_url, ns, moe_sim.url, "--routed-experts", MOE_FLAG, name="prod-b")
    texts: list[str] = []

    def keep(group: Group) -> bool:
        texts.extend(s.response for s in group.samples if isinstance(s.response, str))
        return all(len(s.response.strip()) > 0 for s in group.samples)

    async with await GroupConsumer.connect(redis_url, ns, "trainer-t", payload_check="size") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(2, keep=keep)
        assert sorted(g.index for g in batch.groups) == [0, 1]  # prompt 0 again, generated anew
        again = next(g for g in batch.groups if g.index == 0)
        assert again.attempt == 0 and again.history[-1].startswith("payload: payload store")
        assert all(not isinstance(s.response, UnfetchedText) for g in batch.groups for s in g.samples)
        assert batch.metrics["recycled_payload"] == 1.0
        assert await consumer.commit(batch) == 2
    reason = (await redis.hget(keys.state, StateField.PAYLOAD_LAST_FAILURE) or b"").decode()
    assert f"payload store fs://{store}" in reason and victim in reason
    assert await counter(redis, ns, StateField.RECYCLED_PAYLOAD) == 1
    await nothing_left(redis, ns, store)


# -- the codec: what leaves, what the entry keeps, the placeholder, attach, refusals ------------------

TEXT = "ünïcode ✓ réponse " * 300  # 5,400 characters, 6,900 bytes of UTF-8
BAR = 8192


def text_group(text: str = TEXT, tokens: int = 200) -> Group:
    samples = [
        Sample(
            index=i, tokens=array("i", range(tokens + 1)), response_length=tokens, prompt_length=1, response=text,
            weight_versions=[1], loss_mask=array("B", [1] * tokens), rollout_log_probs=array("f", [-0.5] * tokens),
        )
        for i in range(2)
    ]
    return Group(index=3, prompt="p", samples=samples)


def keys() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"ns/txt-{next(counter)}"


def buffers_of(objects: list[StoreObject]) -> dict[str, memoryview]:
    return {o.ref.key: memoryview(b"".join(bytes(p) for p in o.parts)) for o in objects}


def test_an_8_x_1k_group_without_r3_stays_byte_identical() -> None:
    """Under the default 64 KiB bar (1k tokens: 9 bytes a token of arrays plus 4 characters of text)
    nothing leaves: exactly the bytes the inline encoder writes."""
    group = text_group("word" * 1000, tokens=1000)
    group.samples *= 4
    data, objects = encode_group_offloaded(group, PipelineConfig(n_samples_per_prompt=8, batch_size=8).payload_min_bytes, keys())
    assert objects == [] and data == encode_group(group)


def test_the_text_counts_toward_the_bar_and_leaves_with_the_arrays() -> None:
    group = text_group()
    arrays = 201 * 4 + 200 * 4 + 200
    assert arrays < BAR <= arrays + len(TEXT.encode())  # the arrays alone stay under the bar, with the text not
    data, objects = encode_group_offloaded(group, BAR, keys())
    wire = msgpack.unpackb(data)
    assert wire["v"] == OFFLOAD_VERSION and len(objects) == 2
    for sample in wire["samples"]:
        assert "resp" not in sample
        _offset, nbytes, code, shape, chars = sample["ofl"][1]["resp"]
        assert (nbytes, code, shape, chars) == (len(TEXT.encode()), "B", [nbytes], len(TEXT))
    assert len(data) < 600  # the control fields only
    decoded = decode_group(data)
    assert all(isinstance(s.response, UnfetchedText) for s in decoded.samples)
    assert len(decoded.samples[0].response) == len(TEXT)  # characters, before the fetch
    assert decoded.payload is not None
    decoded.payload.attach(decoded, buffers_of(objects), "fs:///x")
    assert decoded.samples == group.samples and decoded.samples[0].response == TEXT
    # under the bar with the text too: all inline, as today
    data, objects = encode_group_offloaded(group, arrays + len(TEXT.encode()) + 1, keys())
    assert objects == [] and data == encode_group(group)


REFUSED: list[tuple[str, Callable[[Any], object]]] = [
    ("str()", str), ("format", lambda t: f"{t}"), ("format spec", lambda t: format(t, ">5")),
    ("==", lambda t: t == TEXT), ("== reflected", lambda t: TEXT == t), ("!=", lambda t: t != ""),
    ("<", lambda t: t < "a"), ("hash", hash), ("index", lambda t: t[0]), ("slice", lambda t: t[:10]),
    ("iteration", list), ("in", lambda t: "✓" in t), ("+", lambda t: t + "x"), ("+ reflected", lambda t: "x" + t),
    ("%", lambda t: "%s" % t), ("*", lambda t: t * 2), ("bytes", bytes), ("strip", lambda t: t.strip()),  # noqa: UP031
    ("split", lambda t: t.split()), ("encode", lambda t: t.encode()), ("startswith", lambda t: t.startswith("ü")),
    ("in a list", lambda t: t in [TEXT]), ("sorted", lambda t: sorted([t, "a"])),
]


@pytest.mark.parametrize("name, use", REFUSED, ids=[r[0] for r in REFUSED])
def test_unfetched_text_refuses_every_use_but_its_length(name: str, use: Callable[[Any], object]) -> None:
    text = decode_group(encode_group_offloaded(text_group(), BAR, keys())[0]).samples[0].response
    with pytest.raises(PayloadNotFetched, match=r"Sample\.response .* not fetched.*await batch\.fetch\(\)"):
        use(text)


def test_unfetched_text_is_never_a_string() -> None:
    text = decode_group(encode_group_offloaded(text_group(), BAR, keys())[0]).samples[0].response
    assert not isinstance(text, str) and len(text) == len(TEXT) and bool(text)
    assert "UnfetchedText(response, 5400 characters, 6900 bytes" in repr(text)
    with pytest.raises(TypeError):  # json asks nothing of an object it does not know: its own error
        json.dumps(text)
    assert not hasattr(text, "no_such_attribute")


def test_text_that_is_not_utf8_or_not_as_long_is_corrupt_naming_store_and_key() -> None:
    group = text_group()
    data, objects = encode_group_offloaded(group, BAR, keys())
    buffers = buffers_of(objects)
    key = objects[1].ref.key
    raw = bytearray(buffers[key])
    raw[-1] = 0xFF  # the text is last: its final byte no UTF-8
    for damaged in (bytes(raw), bytes(buffers[key][:-2]) + "é".encode()):  # "e " -> "é": valid, a character short
        decoded = decode_group(data)
        assert decoded.payload is not None
        with pytest.raises(PayloadCorrupt, match=rf"payload store fs:///s: object '{key}': Sample\.response"):
            decoded.payload.attach(decoded, {**buffers, key: memoryview(damaged)}, "fs:///s")
        assert not decoded.payload.attached and isinstance(decoded.samples[1].response, UnfetchedText)
        assert isinstance(decoded.samples[0].tokens, Unfetched)  # nothing half attached


def _text_spec(change: Callable[[list[Any]], object]) -> bytes:
    data, _ = encode_group_offloaded(text_group(), BAR, keys())
    wire = msgpack.unpackb(data)
    change(wire["samples"][0]["ofl"][1]["resp"])
    return msgpack.packb(wire)


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop(), "must be"),  # the characters left out
    (lambda s: s.__setitem__(4, 6901), "does not describe UTF-8 text"),  # more characters than bytes
    (lambda s: s.__setitem__(4, 1000), "does not describe UTF-8 text"),  # over 4 bytes a character
    (lambda s: s.__setitem__(2, "i"), "does not describe UTF-8 text"),
    (lambda s: s.__setitem__(3, [6899]), "does not describe UTF-8 text"),
    (lambda s: s.__setitem__(0, 10**9), "does not describe UTF-8 text"),
    (lambda s: s.__setitem__(4, "5400"), "does not describe UTF-8 text"),
])
def test_a_bad_text_reference_is_refused(change: Callable[[list[Any]], object], match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_group(_text_spec(change))


def test_the_text_is_bounded_and_absent_only_where_ofl_names_it() -> None:
    data, _ = encode_group_offloaded(text_group(), BAR, keys())
    with pytest.raises(DecodeError, match="6900 bytes of text exceeds 4096"):
        decode_group(data, CodecLimits(max_string_bytes=4096))
    wire = msgpack.unpackb(data)
    del wire["samples"][0]["ofl"][1]["resp"]  # neither in the entry nor in the object
    with pytest.raises(DecodeError, match="resp"):
        decode_group(msgpack.packb(wire))
    wire = msgpack.unpackb(data)
    wire["samples"][0]["resp"] = "also here"
    with pytest.raises(DecodeError, match="also in the entry"):
        decode_group(msgpack.packb(wire))


def test_a_retry_prompt_refers_to_the_text_and_the_archive_row_says_not_read() -> None:
    from rollstream.common.archive_schema import ArchiveRecord, record_row

    data, objects = encode_group_offloaded(text_group(), BAR, keys())
    group = decode_group(data)
    assert group.payload is not None
    prompt = retry_prompt(group, "aborted", keep_partial=True)
    prompt.payload = group.payload
    again = decode_prompt(encode_prompt(prompt))
    assert again.partial is not None and again.payload is not None
    assert isinstance(again.partial[0].response, UnfetchedText) and len(again.partial[0].response) == len(TEXT)
    again.payload.attach(Group(index=3, prompt="p", samples=again.partial), buffers_of(objects), "fs:///x")
    assert again.partial[0].response == TEXT
    record = ArchiveRecord("1-0", "trained", "", "t", 0, 0, "groups", 0, 0, "5-0", 0, {b"data": data})
    row = record_row(record)
    assert row["decode_error"] and [c["response"] for c in row["samples"]] == [None, None]
    from rollstream.ops.archive_view import NOT_READ, page_record

    assert [s["response"] for s in page_record(row)["samples"]] == [NOT_READ, NOT_READ]  # the page says why
