"""On-policy distillation: every response scored by a teacher model before the group is published.

The teacher is an SGLang server asked for the log-probs of given tokens: ``/generate`` with the
sample's ``tokens`` as ``input_ids``, ``max_new_tokens`` 0, ``return_logprob`` and
``logprob_start_len`` at the last prompt token, so ``meta_info.input_token_logprobs`` ends with
one entry per response token (each checked against the token it scores). The requests go through
an :class:`~rollstream.producer.engine.EngineClient` of their own, so they have the policy
engine's retries, deadline and reply bound, and the same failure rules: a refusal or an unusable
reply fails the sample (the group is recycled); an engine that keeps failing after its retries
is fatal for the producer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from array import array
from typing import Any

from rollstream.common.errors import EngineRejected
from rollstream.common.models import Sample, Status

from .engine import EngineClient, EngineSettings
from .engine.sglang import parse_teacher

TEACHER_API = "sglang"
"""The teacher's engine API: the log-probs of given tokens are SGLang's ``/generate`` form."""


class TeacherScorer:
    """Sets ``teacher_log_probs`` on the samples of a group (use as ``async with``)."""

    def __init__(self, client: EngineClient, *, temperature: float = 1.0) -> None:
        self.client = client
        self.temperature = temperature
        self.scored = 0
        self.failed = 0

    @staticmethod
    def engine_settings(policy: EngineSettings, urls: tuple[str, ...]) -> EngineSettings:
        """The teacher's engine client settings: the policy engines' limits and timeouts, on
        ``urls`` with the teacher's API (no routing replay)."""
        return dataclasses.replace(policy, urls=urls, registry_urls=(), routed_experts=None, api=TEACHER_API)

    async def __aenter__(self) -> TeacherScorer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def score(self, samples: list[Sample]) -> None:
        """Score every COMPLETED or TRUNCATED sample concurrently; a sample the teacher refuses
        becomes FAILED with the reason."""
        async with asyncio.TaskGroup() as tasks:
            for sample in samples:
                if sample.status in (Status.COMPLETED, Status.TRUNCATED):
                    tasks.create_task(self._score_one(sample))

    async def _score_one(self, sample: Sample) -> None:
        if sample.prompt_length <= 0:
            self._fail(sample, "teacher scoring needs the prompt token ids (--tokenizer, or tokenised prompts)")
            return
        body: dict[str, Any] = {
            "input_ids": sample.tokens if isinstance(sample.tokens, array) else array("i", sample.tokens),
            "sampling_params": {"max_new_tokens": 0, "temperature": self.temperature},
            "return_logprob": True,
            "logprob_start_len": sample.prompt_length - 1,
        }
        try:
            url, raw = await self.client.post("/generate", body)
            log_probs = parse_teacher(raw, sample.tokens, sample.response_length, where=f"{url}/generate")
        except EngineRejected as exc:
            self._fail(sample, f"teacher: {exc}"[:1000])
            return
        sample.teacher_log_probs = log_probs
        self.scored += 1

    def _fail(self, sample: Sample, error: str) -> None:
        self.failed += 1
        sample.status = Status.FAILED
        sample.finish_reason = "teacher_failed"
        sample.error = error
