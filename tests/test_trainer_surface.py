"""The trainer's surface: connect as an awaitable and as a context manager, typed options,
the keep verdict rule, and the errors exported from ``rollstream.consumer``."""

from __future__ import annotations

import asyncio

import pytest
import rollstream.consumer as consumer_pkg
from conftest import make_namespace
from redis.asyncio import Redis
from rollstream.common import errors
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
