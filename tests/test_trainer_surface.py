"""The trainer's surface: connect as an awaitable and as a context manager, typed options,
the keep verdict rule, and the errors exported from ``rollstream.consumer``."""

from __future__ import annotations

import asyncio
import gc

import pytest
import rollstream.consumer as consumer_pkg
from conftest import make_namespace
from redis.asyncio import Redis
from rollstream.common import errors
from rollstream.common.codec import group_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Sample
from rollstream.consumer import (
    ConfigError,
    GroupConsumer,
    NamespaceNotInitialized,
    RollstreamError,
    SyncGroupConsumer,
    rejection_reason,
)


async def test_connect_is_an_async_context_manager(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    async with GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=5.0) as consumer:
        assert isinstance(consumer, GroupConsumer)
        assert consumer.stall_timeout == 5.0
        assert await consumer.weight_version() == 0


async def test_connect_can_still_be_awaited(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    consumer = await GroupConsumer.connect(redis_url, ns, "trainer", n_samples=2, batch_size=4)
    try:
        assert consumer.config.n_samples_per_prompt == 2
    finally:
        await consumer.aclose()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as again:
        assert again.name == "trainer"


async def test_connect_errors_are_config_errors(redis: Redis, redis_url: str, ns: str) -> None:
    with pytest.raises(NamespaceNotInitialized) as caught:
        async with GroupConsumer.connect(redis_url, ns, "trainer"):
            pass
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, RollstreamError)
    await make_namespace(redis, ns)
    with pytest.raises(ConfigError):
        await GroupConsumer.connect(redis_url, ns, "trainer", n_samples=3)
    with pytest.raises(ConfigError):
        await GroupConsumer.connect(redis_url, ns, "trainer", stall_timeout=0)


async def test_sync_consumer_takes_the_same_typed_options(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)

    def run() -> None:
        with pytest.raises(ConfigError):
            SyncGroupConsumer(redis_url, ns, "trainer", on_producer_failure="ignore")  # type: ignore[arg-type]
        with SyncGroupConsumer(redis_url, ns, "trainer", on_producer_failure="warn") as consumer:
            assert consumer.weight_version() == 0

    await asyncio.to_thread(run)


def test_keep_verdict_truthy_keeps_strings_and_falsy_reject() -> None:
    assert rejection_reason(True) is None
    assert rejection_reason(1) is None
    assert rejection_reason(False) == "rejected"
    assert rejection_reason(None) == "rejected"
    assert rejection_reason("") == "rejected"
    assert rejection_reason("zero_variance") == "zero_variance"


def test_keep_verdict_accepts_numpy_booleans() -> None:
    numpy = pytest.importorskip("numpy")
    assert rejection_reason(numpy.bool_(True)) is None
    assert rejection_reason(numpy.bool_(False)) == "rejected"


def test_every_trainer_error_is_exported() -> None:
    for name in ("RollstreamError", "ConfigError", "NamespaceNotInitialized", "DecodeError",
                 "PipelineError", "ProducerFailed", "PipelineStalled"):
        assert name in consumer_pkg.__all__
        assert getattr(consumer_pkg, name) is getattr(errors, name)


async def test_numpy_views_of_a_batch_are_zero_copy_and_outlive_commit_and_close(
    redis: Redis, redis_url: str, ns: str
) -> None:
    np = pytest.importorskip("numpy")
    await make_namespace(redis, ns, n_samples_per_prompt=2)
    keys = Keys(ns)
    for index in range(3):
        samples = [
            Sample(index=i, tokens=[index, i, 7, 8, 9], response_length=3, rollout_log_probs=[-0.5, -1.0, -1.5],
                   loss_mask=[1, 0, 1], weight_versions=[0])
            for i in range(2)
        ]
        await redis.xadd(keys.groups, group_fields(Group(index=index, prompt="p", samples=samples)))
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        batch = await consumer.take(3)
        tokens, log_probs, masks = batch.tokens_numpy(), batch.log_probs_numpy(), batch.loss_masks_numpy()
        first = batch.groups[0].samples[0]
        assert tokens[0].dtype == np.int32 and log_probs[0] is not None and log_probs[0].dtype == np.float32
        # views on the reply's bytes: neither take() nor the numpy accessors copied the arrays
        assert isinstance(first.tokens, memoryview) and isinstance(first.tokens.obj, bytes)
        reply_bytes = np.frombuffer(first.tokens.obj, dtype=np.uint8)
        assert np.shares_memory(tokens[0], reply_bytes) and np.shares_memory(log_probs[0], reply_bytes)
        assert masks[0] is not None and np.shares_memory(masks[0], reply_bytes)
        assert await consumer.commit(batch) == 3
    assert await redis.xlen(keys.groups) == 0  # the entries are gone from Redis
    del batch, first, reply_bytes
    gc.collect()
    assert [t.tolist() for t in tokens] == [[g, i, 7, 8, 9] for g in range(3) for i in range(2)]
    assert all(lp is not None and lp.tolist() == [-0.5, -1.0, -1.5] for lp in log_probs)
    assert all(m is not None and m.tolist() == [1, 0, 1] for m in masks)


async def test_a_take_whose_read_swallows_the_cancellation_still_ends(redis_url: str, redis: Redis, ns: str) -> None:
    """A cancelled take() must end even when the library under it loses the cancellation (Python
    3.11's ``asyncio.wait_for`` in redis-py can): made deterministic with a read that swallows it.
    Found as test_ops' dead-requeue test hanging in ``take.cancel(); gather(take)`` under load."""
    await make_namespace(redis, ns)
    async with await GroupConsumer.connect(redis_url, ns, "trainer-sw", on_producer_failure="warn") as consumer:
        read = consumer._read
        reading = asyncio.Event()
        swallowed = asyncio.Event()

        async def swallowing_read(count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
            reading.set()
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                swallowed.set()  # and carry on as if nothing happened
            return await read(count)

        consumer._read = swallowing_read  # type: ignore[method-assign]
        take = asyncio.create_task(consumer.take(1))
        await asyncio.wait_for(reading.wait(), 10)
        take.cancel()
        done, _ = await asyncio.wait([take], timeout=10)  # the next turn is at most one blocking read away
        assert swallowed.is_set() and take in done and take.cancelled()
