"""One token sequence of an episode (:class:`SessionTrajectory`: the episode's main trajectory or
a segment), whose tokens, loss mask, log-probs, versions and version spans grow together, so they
cannot drift apart."""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollstream.common.arrays import Packed
from rollstream.common.errors import EpisodeAborted, PromptNotSupported
from rollstream.common.models import Sample, Status

from .durable import request_digest, routing_rows
from .engine import Generation
from .engine.ids_json import IdsJson
from .episode import SamplingParams, Trajectory, Turn

if TYPE_CHECKING:
    from .session import EpisodeSession


class SessionTrajectory(Trajectory):
    """One growing token sequence; every append keeps tokens, mask, log-probs and spans aligned."""

    def __init__(
        self, session: EpisodeSession, prompt_ids: Sequence[int] | None, source: dict[str, Any] | PromptNotSupported,
        number: int = 0,
    ) -> None:
        self.number = number
        """0 for the episode's main trajectory, k for its k-th segment (names it in the journal)."""
        # A weak reference: the session holds its trajectories, and a cycle between them would
        # leave every finished episode (its arrays, replies, tasks) to the cyclic collector
        # instead of freeing it at once (producer/gcpolicy.py)
        self._session: EpisodeSession = weakref.proxy(session)
        self.tokens = array("i", prompt_ids or ())
        self.prompt_length = len(self.tokens)
        self.known_prompt = prompt_ids is not None
        self._source = source
        """How to send the prompt while its ids are unknown (text or messages), or why it cannot be."""
        self.mask = array("B")
        self.log_probs: array[float] | None = array("f")
        self.text: list[str] = []
        self.versions: list[int] = []
        self.spans: list[tuple[int, int, int]] = []
        self.finish_reason: str | None = None
        self.status = Status.COMPLETED
        self.metadata: dict[str, Any] = {}
        self.generations: list[Generation] = []
        """Every engine reply that added to this trajectory, in order (the routing replay's source)."""
        self.rows: Packed | None = None
        """Durable episodes: the routing rows the replies so far add up to (journaled as a delta)."""
        self._encoded: IdsJson | None = None
        """The JSON text of :attr:`tokens` so far (they are only appended to), for the next request."""

    def continue_from(self, prefix: Sample) -> None:
        """Seed with an earlier attempt's aborted sample (the default rollout, partial rollout on)."""
        self.tokens = array("i", prefix.tokens)
        self.prompt_length = prefix.prompt_length
        self.known_prompt = True
        mask = prefix.loss_mask
        self.mask = array("B", mask) if mask is not None else array("B", b"\x01" * prefix.response_length)
        self.log_probs = None if prefix.rollout_log_probs is None else array("f", prefix.rollout_log_probs)
        self.rows = prefix.routed_experts
        self.text = [prefix.response]
        self.versions = list(prefix.weight_versions)
        spans = prefix.weight_version_spans
        if not spans and prefix.response_length:  # one call: its tokens share a version (the oldest if unsure)
            spans = [(0, prefix.response_length, min(prefix.weight_versions, default=0))]
        self.spans = list(spans or ())
        self.metadata = {**prefix.metadata, "continued_from": prefix.response_length}
        self._session.multi_turn = True  # the sample spans calls: publish each token's version

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def sample(self) -> Sample:
        """A snapshot (its own arrays: a sample taken before a later turn stays consistent)."""
        return Sample(
            index=self._session.info.member,
            tokens=array("i", self.tokens),
            response="".join(self.text),
            response_length=self.response_length,
            prompt_length=self.prompt_length,
            status=self.status,
            finish_reason=self.finish_reason,
            weight_versions=list(self.versions),
            rollout_log_probs=None if self.log_probs is None else array("f", self.log_probs),
            loss_mask=array("B", self.mask),
            metadata=dict(self.metadata),
            weight_version_spans=list(self.spans) if self._session.multi_turn else None,
        )

    @property
    def room(self) -> int | None:
        budget = self._session.runtime.limits.max_context
        return None if budget is None else max(0, budget - len(self.tokens))

    async def generate(
        self, *, max_new_tokens: int | None = None, sampling: SamplingParams | None = None, **params: Any
    ) -> Turn:
        session = self._session
        sampling = sampling if sampling is not None else session.info.sampling
        if params:
            sampling = sampling.replace(**params)
        limit = self._limit(max_new_tokens, sampling)
        if limit <= 0:  # nothing may be added: the trajectory is at its length budget
            self.finish_reason, self.status = "length", Status.TRUNCATED
            return Turn("", array("i"), array("f"), "length", ())
        session.boundary()
        digest = b""
        if session.log is not None:
            extra = [limit, session.runtime.sampling_dict(sampling), None if self.known_prompt else self._source]
            digest = request_digest("g", self.number, self.tokens if self.known_prompt else None, extra)
        turn, prompt_ids = await session.journaled(
            "g", digest,
            lambda: session.call(self._request_source(), limit, sampling, continuable=self.known_prompt),
            lambda reply: None if session.aborted else session.turn_step("g", digest, *reply, self.rows),
            session.replayed,
        )
        self._append(turn, prompt_ids)
        if session.aborted:
            self.status = Status.ABORTED
            raise aborted()
        session.boundary()
        return turn

    def _limit(self, max_new_tokens: int | None, sampling: SamplingParams) -> int:
        """The tokens the next call may add: asked for, within the length budget's room."""
        limit = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        room = self.room
        return limit if room is None else min(limit, room)

    def _request_source(self) -> dict[str, Any]:
        """What the next request sends as its prompt: the token ids so far, else (a first call
        whose prompt ids are unknown) the prompt's text or messages."""
        if self.known_prompt:
            encoded = self._encoded
            if encoded is None or encoded.source is not self.tokens:
                self._encoded = encoded = IdsJson(self.tokens)
            return {"input_ids": encoded.ids()}  # each token JSON-encoded once, in the body
        if self.response_length == 0:
            if isinstance(self._source, PromptNotSupported):
                raise self._source
            return self._source
        raise PromptNotSupported(
            "a multi-turn episode needs the prompt's token ids: give --tokenizer, or an engine "
            "with /tokenize (or one that returns prompt token ids)"
        )

    def _append(self, turn: Turn, prompt_ids: array[int] | None) -> None:
        """Add a call's turn: tokens, mask, log-probs, text, versions and spans together, the
        replies it came from, and the finish reason, status and metadata it ended with."""
        session = self._session
        if not self.known_prompt and prompt_ids is not None:  # the engine said (vLLM return_token_ids)
            self.tokens = array("i", prompt_ids)
            self.prompt_length = len(self.tokens)
            self.known_prompt = True
        start = self.response_length
        self.tokens.extend(turn.token_ids)
        self.mask.frombytes(b"\x01" * len(turn.token_ids))
        if self.log_probs is not None:
            if turn.log_probs is None:
                self.log_probs = None  # the engine does not give them: none for the whole sample
            else:
                self.log_probs.extend(turn.log_probs)
        self.text.append(turn.text)
        self.versions.extend(turn.weight_versions)
        self.generations.extend(session.last_generations)
        if session.log is not None:
            self.rows = routing_rows(self.rows, session.last_generations)
        self.spans.extend((start + s, start + e, v) for s, e, v in turn.weight_version_spans)
        self.finish_reason = turn.finish_reason
        self.status = turn.status
        self.metadata.update(session.last_call_metadata)
        session.turns += 1

    async def observe(self, content: str | Sequence[int]) -> int:
        if not self.known_prompt:
            raise PromptNotSupported("observing tokens needs the prompt's token ids (--tokenizer or /tokenize)")
        session = self._session
        session.boundary()
        if isinstance(content, str):
            ids: Sequence[int] = await session.tokenize(content)
        else:
            ids = content
        room = self.room
        if room is not None and len(ids) > room:
            ids = ids[:room]
        before = len(self.tokens)
        self.tokens.extend(ids)  # TypeError / OverflowError on anything but int32 ids: the sample fails
        if isinstance(content, str):
            self.text.append(content)
        added = len(self.tokens) - before
        self.mask.frombytes(b"\x00" * added)
        if self.log_probs is not None:
            self.log_probs.frombytes(b"\x00" * (4 * added))
        if session.log is not None:  # the observation is the step: journaled, or matched on a replay
            digest = request_digest("o", self.number, self.tokens[before:], None)
            await session.journaled("o", digest, _observed, lambda _: {"k": "o", "r": digest}, lambda _: None)
            session.boundary()
        return added


def aborted() -> EpisodeAborted:
    return EpisodeAborted(
        "an engine call was aborted (a weight update?) and could not be continued (partial rollout "
        "off, or no prompt ids): the episode is recycled whole"
    )


async def _observed() -> None:
    """An observation's live step: its tokens are already appended (only the journal records it)."""
