"""The scale benchmark's costs on an idle Redis (``bench.scale``): one group by size (the PUBLISH
script, the trainer's read and commit, each alone; bytes on the wire, Redis memory per group),
ADMIT against the number of producers, and the reclaim check against the pending list: the
inputs of the ceiling in docs/scale.md."""

from __future__ import annotations

from typing import Any

from rollstream.common import lua
from rollstream.common.codec import group_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP
from rollstream.common.protocol import GroupQueue, PromptQueue
from rollstream.ops.namespaces import delete_namespace

from bench.common import add_prompts, init_ns, make_group
from bench.scale_meter import Meter, command_delta
from bench.scale_spec import N, Spec
from bench.worker import ADMIT_BEFORE

# -- the cost of one group by size -------------------------------------------------------------


async def sizes(spec: Spec, url: str, meter: Meter) -> list[dict[str, Any]]:
    out = []
    for n, tokens in spec.sizes:
        redis = connect(url)
        ns = f"scalesize-{n}x{tokens}"
        keys = await init_ns(redis, ns, n_samples_per_prompt=n, batch_size=spec.size_repeats, max_backlog=10**6)
        reps = spec.size_repeats if n * tokens <= 8 * 8192 else max(4, spec.size_repeats // 3)
        await add_prompts(redis, keys, 0, reps)
        queue = PromptQueue(redis, keys, "sizer")
        admitted = await queue.admit(PipelineConfig(n_samples_per_prompt=n, batch_size=reps, max_backlog=10**6), reps)
        fields = group_fields(make_group(n, tokens))
        wire = sum(len(str(k)) + len(v if isinstance(v, bytes) else str(v)) for k, v in fields.items())
        phases: dict[str, dict[str, float]] = {}
        a = await meter.mark()
        for item in admitted.entries:
            await queue.publish(item.stream, item.entry_id, fields)
        b = await meter.mark()
        phases["publish"] = _phase(a, b, len(admitted.entries), "evalsha")
        blocking = connect(url, block_ms=2000)
        groups = GroupQueue(redis, keys, "sizer")
        a = await meter.mark()
        got: list[Any] = []
        while len(got) < len(admitted.entries):
            got += await groups.read(blocking, len(admitted.entries) - len(got), 1000)
        b = await meter.mark()
        phases["take"] = _phase(a, b, len(got), "xreadgroup")
        memory_per_group = (a["used_memory"] - phases["publish"]["memory_before"]) / len(got)
        a = await meter.mark()
        await groups.commit([eid for eid, _ in got])
        b = await meter.mark()
        phases["commit"] = _phase(a, b, len(got), "evalsha")
        await blocking.aclose()
        await delete_namespace(redis, keys)
        await redis.aclose()
        out.append({"n": n, "tokens": tokens, "groups": len(got), "wire_bytes": wire,
                    "memory_bytes": memory_per_group, **{k: v for k, v in phases.items()}})
    return out


def _phase(a: dict[str, Any], b: dict[str, Any], count: int, command: str) -> dict[str, float]:
    delta = command_delta(a, b)
    return {
        "cpu_us": (b["redis_cpu"] - a["redis_cpu"]) / count * 1e6,
        "command_us": delta.get(command, {"usec": 0})["usec"] / count,
        "memory_before": a["used_memory"],
    }


# -- ADMIT against the number of producers; the reclaim check against the pending list ---------


async def admit_costs(spec: Spec, url: str, meter: Meter) -> list[dict[str, Any]]:
    """ADMIT's Redis cost with C producers known to the consumer group (each holding one
    prompt, as in a run), this code against the code before the fix, side by side."""
    out = []
    calls = 100
    for consumers in spec.admit_consumers:
        redis = connect(url)
        keys = await init_ns(redis, f"scaleadmit-{consumers}", n_samples_per_prompt=N, batch_size=64,
                             max_backlog=10**6, max_staleness=10**6)
        await add_prompts(redis, keys, 0, consumers + 2 * calls + 8, with_ids=False)
        async with redis.pipeline(transaction=False) as pipe:
            for c in range(consumers):
                pipe.xreadgroup(PRODUCERS_GROUP, f"p{c}", {keys.prompts: ">"}, count=1)
                pipe.xreadgroup(PRODUCERS_GROUP, f"p{c}", {keys.retry: ">"}, count=1)
            await pipe.execute()
        row: dict[str, Any] = {"consumers": consumers}
        for label, declared in (("before", ADMIT_BEFORE), ("this code", lua.ADMIT)):
            script = redis.register_script(declared.source)
            script_keys, args = declared.lists(keys, {
                "consumer": "admitter", "max_backlog": 10**6, "admission": 1, "max_staleness": 10**6, "batch_size": 64,
                "steps_per_version": 1, "count": 1, "now_ms": 0, "max_backlog_bytes": 0,
            })
            await script(keys=script_keys, args=args)
            a = await meter.mark()
            for _ in range(calls):
                await script(keys=script_keys, args=args)
            b = await meter.mark()
            row[label] = {"command_us": command_delta(a, b)["evalsha"]["usec"] / calls,
                          "cpu_us": (b["redis_cpu"] - a["redis_cpu"]) / calls * 1e6}
        out.append(row)
        await delete_namespace(redis, keys)
        await redis.aclose()
    return out


async def reclaim_check_costs(spec: Spec, url: str, meter: Meter) -> list[dict[str, Any]]:
    """One producer's reclaim check (``any_idle``: XPENDING IDLE lease COUNT 1, nothing idle)
    against the size of the pending list: it walks the whole list."""
    out = []
    calls = 50
    for size in spec.pending_sizes:
        redis = connect(url)
        keys = await init_ns(redis, f"scalepel-{size}", n_samples_per_prompt=N, batch_size=64)
        for start in range(0, size, 5000):
            await add_prompts(redis, keys, start, min(5000, size - start), with_ids=False)
        await redis.xreadgroup(PRODUCERS_GROUP, "holder", {keys.prompts: ">"}, count=size)
        queue = PromptQueue(redis, keys, "checker")
        a = await meter.mark()
        for _ in range(calls):
            await queue.any_idle(3_600_000)
        b = await meter.mark()
        delta = command_delta(a, b)["xpending"]
        out.append({"pending": size, "command_us": delta["usec"] / calls,
                    "cpu_us": (b["redis_cpu"] - a["redis_cpu"]) / calls * 1e6})
        await delete_namespace(redis, keys)
        await redis.aclose()
    return out
