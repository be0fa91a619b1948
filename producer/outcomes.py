"""What an episode ends as, outside the rollout's control flow: the samples of a generation (the
one request of ``n``), of a failure and of a refusal, and the rate-limited log of failures."""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

from rollstream.common.errors import EngineRejected
from rollstream.common.models import Sample, Status

from .engine import Generation

logger = logging.getLogger("rollstream.producer.rollout")
"""The rollout's logger: the failure lines keep the name they always had."""

FAILURE_LOG_INTERVAL = 60.0
"""Seconds between two log lines of the same failure reason (the others are counted)."""


class FailureLog:
    """Logs a failure once per ``reason`` and ``interval``; the next line says how many were not."""

    def __init__(self, interval: float = FAILURE_LOG_INTERVAL) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def report(self, reason: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        self._last[reason] = now
        quiet = self._quiet.pop(reason, 0)
        more = f" ({quiet} more like it in the last {self.interval:.0f} s)" if quiet else ""
        logger.warning("%s%s", message, more)


def to_sample(index: int, prompt_ids: array[int] | None, generation: Generation, admitted_version: int) -> Sample:
    """A sample of the one request of ``n`` (OpenAI ``n``, vLLM's ``/inference/v1/generate``)."""
    metadata: dict[str, Any] = {"engine": generation.engine}
    if prompt_ids is None and generation.prompt_ids is not None:
        prompt_ids = array("i", generation.prompt_ids)  # the engine said (vLLM return_token_ids)
    spans = generation.weight_version_spans
    if generation.weight_version is None:
        versions = [admitted_version]
        metadata["weight_version_source"] = "trainer_at_admission"
    elif spans:
        metadata["weight_version_source"] = "engine_spans"
        versions = list(dict.fromkeys(v for v, _, _ in spans))  # each version once, in order
    elif generation.weight_version_before is not None:  # moved while it ran, nothing says where
        versions = [generation.weight_version_before, generation.weight_version]
        metadata["weight_version_split"] = "unknown"
    else:
        versions = [generation.weight_version]
    token_spans = None
    if spans and len(versions) > 1:  # the tokens span two versions: say which where
        metadata["weight_version_spans"] = [list(span) for span in spans]
        token_spans = [(start, end, version) for version, start, end in spans]
    tokens = (prompt_ids if prompt_ids is not None else array("i")) + array("i", generation.output_ids)
    return Sample(
        index=index,
        tokens=tokens,
        response=generation.text,
        response_length=len(generation.output_ids),
        prompt_length=0 if prompt_ids is None else len(prompt_ids),
        loss_mask=ones(len(generation.output_ids)),
        status=Status.from_finish_reason(generation.finish_reason),
        finish_reason=generation.finish_reason,
        weight_versions=versions,
        rollout_log_probs=None if generation.log_probs is None else array("f", generation.log_probs),
        metadata=metadata,
        weight_version_spans=token_spans,
    )


def failed(index: int, prompt_ids: array[int] | None, reason: str, kind: str) -> Sample:
    """A FAILED sample of an episode that raised, timed out or returned something unusable."""
    return Sample(
        index=index,
        tokens=prompt_ids if prompt_ids is not None else array("i"),
        prompt_length=0 if prompt_ids is None else len(prompt_ids),
        loss_mask=array("B"),
        status=Status.FAILED,
        finish_reason=kind,
        error=reason[:1000],
    )


def rejected(index: int, prompt_ids: array[int] | None, exc: EngineRejected) -> Sample:
    """A FAILED sample: the engine refused the request; the consumer recycles the group."""
    return failed(index, prompt_ids, str(exc), "rejected")


def ones(count: int) -> array[int]:
    """The loss mask of a response: every response token is trained on."""
    return array("B", b"\x01" * count)
