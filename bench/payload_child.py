"""A producer for bench/payload.py, in its own process: admits prompts and publishes a group under
each through the real protocol, as ``Producer`` does: ADMIT; with a payload store configured the
arrays past ``--payload-min-bytes`` leave the entry (``group_fields_offloaded``) and are put in
the store first (``PayloadPlane.put``: their intents, then the objects); then PUBLISH.

``python -m bench.payload_child --redis URL --ns NS --dir D --stages 1:8192,2:8192,8:4096/12288``
builds its groups (16 samples by default; ``--r3``: with a 48 x 8 routing replay), touches
``D/ready``, then for each stage ``i`` (``count:tokens[/tokens...]``, the token counts taken in
turn) waits for ``D/go.i``, publishes that many groups (encoding each anew, as a producer does)
and touches ``D/done.i``. At the end it writes ``D/child.json`` (seconds per stage, puts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from array import array
from pathlib import Path
from typing import Any

import numpy
from rollstream.common.arrays import Packed
from rollstream.common.codec import group_fields
from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Sample
from rollstream.common.namespace import load_config
from rollstream.common.protocol import PromptQueue

from bench.common import PROMPT_TOKENS, R3_SHAPE

WAIT = 600.0
"""The longest a stage waits for its go file (a parent that died leaves the child to time out)."""


CHARS_PER_TOKEN = 4
"""Characters of response text a token: about what a real tokenizer gives for English text."""
_TEXT = "The answer follows from the two facts above, so we add them and check the sum again. "


def response_text(tokens: int) -> str:
    """``tokens`` tokens' worth of plain text (:data:`CHARS_PER_TOKEN` characters each)."""
    size = CHARS_PER_TOKEN * tokens
    return (_TEXT * (size // len(_TEXT) + 1))[:size]


def bench_group(samples: int, tokens: int, r3: bool, seed: int = 0) -> Group:
    """A group of ``samples`` x (64 prompt + ``tokens`` response) ids with log-probs, a loss mask
    (the producer always fills one) and a response text of :data:`CHARS_PER_TOKEN` characters a
    token (as a real tokenizer's text, so the entry's size is honest) and, with ``r3``, a
    ``(len - 1, 48, 8)`` uint8 routing replay of 128 experts (random, built with numpy:
    bench.common.make_group's values, made fast enough to build several sizes)."""
    rng = numpy.random.default_rng(seed)
    layers, topk, experts = R3_SHAPE
    out = []
    for i in range(samples):
        ids = array("i", rng.integers(0, 152_000, PROMPT_TOKENS + tokens, dtype=numpy.int32).tobytes())
        sample = Sample(
            index=i, tokens=ids, response=response_text(tokens), response_length=tokens, reward=1.0,
            finish_reason="stop", weight_versions=[0],
            rollout_log_probs=array("f", (-5 * rng.random(tokens, dtype=numpy.float32)).tobytes()),
            loss_mask=array("B", b"\x01" * tokens), metadata={"engine": "http://engine"},
        )
        if r3:
            rows = PROMPT_TOKENS + tokens - 1
            replay = rng.integers(0, experts, rows * layers * topk, dtype=numpy.uint8)
            sample.routed_experts = Packed(array("B", replay.tobytes()), (rows, layers, topk))
        out.append(sample)
    return Group(index=0, prompt="What is 1+1?", samples=out, label="2", producer="bench")


def _wait_file(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {WAIT} s")
        time.sleep(0.002)


def parse_stages(text: str) -> list[tuple[int, list[int]]]:
    stages = []
    for part in text.split(","):
        count, _, sizes = part.partition(":")
        stages.append((int(count), [int(s) for s in sizes.split("/")]))
    return stages


async def produce(args: argparse.Namespace) -> dict[str, Any]:
    redis = connect(args.redis)
    keys = Keys(args.ns)
    config = await load_config(redis, keys)
    queue = PromptQueue(redis, keys, args.name)
    plane: Any = None
    if config.payload_store:  # as producer/worker.py does
        from rollstream.common.codec import group_fields_offloaded
        from rollstream.common.payload.plane import PayloadPlane

        plane = PayloadPlane.open(config.payload_store, redis, keys, config.lease_seconds)
    sizes = sorted({tokens for _, cycle in args.stages for tokens in cycle})
    groups = {tokens: bench_group(args.samples, tokens, args.r3, seed=tokens) for tokens in sizes}
    out: dict[str, Any] = {"stages": [], "refused": 0, "put_s": 0.0, "put_bytes": 0}
    args.dir.joinpath("ready").touch()
    for i, (count, cycle) in enumerate(args.stages):
        await asyncio.to_thread(_wait_file, args.dir / f"go.{i}")
        started = time.perf_counter()
        published = 0
        async with asyncio.timeout(WAIT):
            while published < count:
                admission = await queue.admit(config, 1)
                if admission.status != "ok" or not admission.entries:
                    out["refused"] += 1
                    await asyncio.sleep(0.002)
                    continue
                for admitted in admission.entries:
                    group = groups[cycle[published % len(cycle)]]
                    group.index = int(admitted.fields[b"index"])
                    refs: list[Any] = []
                    if plane is not None:
                        fields, objects = group_fields_offloaded(group, config.payload_min_bytes, plane.new_key)
                        put = time.perf_counter()
                        await plane.put(objects)
                        out["put_s"] += time.perf_counter() - put
                        out["put_bytes"] += sum(o.ref.size for o in objects)
                        refs = [o.ref for o in objects]
                        published_id = await queue.publish(admitted.stream, admitted.entry_id, fields, None, refs)
                    else:
                        fields = group_fields(group)
                        published_id = await queue.publish(admitted.stream, admitted.entry_id, fields)
                    if published_id is not None:
                        published += 1
        out["stages"].append({"groups": published, "seconds": time.perf_counter() - started})
        args.dir.joinpath(f"done.{i}").touch()
    if plane is not None:
        await plane.close()
    await redis.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.payload_child")
    parser.add_argument("--redis", required=True)
    parser.add_argument("--ns", required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--name", default="payload-producer")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--r3", action="store_true")
    parser.add_argument("--stages", type=parse_stages, required=True, help="count:tokens[/tokens...],...")
    args = parser.parse_args()
    result = asyncio.run(produce(args))
    (args.dir / "child.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
