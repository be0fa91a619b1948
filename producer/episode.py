"""The rollout plug-in contract: what a user's generate function is given and what it returns.

A rollout is one function, named by ``rollstream produce --generate module:function``::

    async def generate(episode: Episode) -> Sample | list[Sample]:
        turn = await episode.generate()                  # engine tokens: loss mask 1, log-probs kept
        while (call := find_tool_call(turn.text)) and episode.room != 0:
            async with episode.limit("sandbox"):          # a named limit (--limit sandbox=4)
                result = await run_tool(call)            # no engine slot is held here
            await episode.observe(result)                # tool tokens: loss mask 0, log-prob 0
            turn = await episode.generate()
        return episode.sample

The producer calls it once per group member (``n`` episodes per prompt attempt; an attempt stays
the unit that is leased, published, recycled or dead-lettered, DESIGN.md §4.11). The user never
writes an HTTP call, a retry or an alignment rule:

* :meth:`Episode.generate` sends the trajectory's tokens so far to an engine (the least loaded,
  with the engine client's retries), holding one engine slot only while the request runs, and
  appends the reply's tokens (loss mask 1, the engine's log-probs) and its weight version.
  ``max_new_tokens`` is clamped to the room left under the context budget (``--max-context``).
* :meth:`Episode.observe` appends tool or environment tokens (text is tokenized by the
  producer's tokenizer, else the engine's ``/tokenize``): loss mask 0, log-prob 0.
* Aborts (a weight update): with partial rollout on (namespace ``partial_rollout``) the call
  waits for the pipeline to resume and continues from the accumulated tokens, so a turn can
  hold tokens of two versions (:attr:`Turn.weight_versions`, ``Sample.weight_version_spans``);
  with it off it raises :class:`EpisodeAborted` out of the user's code, and the whole group is
  ABORTED and recycled. Catching it changes nothing: the session remembers.
* Errors cost one sample: an exception, the episode deadline (``--episode-timeout``; the
  function is cancelled) or an invalid result FAILS the sample with the reason; the group is
  recycled with ``attempt + 1`` and dead-lettered after ``max_attempts``. A function that fails
  on many distinct prompts in a row is broken (:class:`GenerateBroken`, fatal for the producer,
  loud at the trainer).

Durable episodes (``rollstream init --durable-episodes``, :mod:`.durable`): every finished step
(an engine reply, an ``observe()``, an :meth:`Episode.once` result) is journaled in Redis, and a
producer that takes the prompt over (its producer was killed or drained) runs the function
again with the calls answered from the journal while they ask the same thing; the code between
them (tools) runs again. A draining producer stops such episodes at a step boundary
(:class:`~rollstream.common.errors.EpisodeDrained`: let it pass).

Returning several samples (segments, or agents of one episode): build each with
:meth:`Episode.segment` (or by hand) and return the list; they all get the episode's
``member`` as ``Sample.index`` (the episode id inside the group) and ``metadata["segment"]``.
Every returned sample is validated before publish (:func:`rollstream.producer.checks.check_sample`).

Stable names (the adapters for slime's and miles' generate functions build on them):
:class:`SamplingParams`, :class:`EpisodeInfo`, :class:`Turn`, :class:`Trajectory`,
:class:`Episode`, :data:`GenerateFunction`, :class:`EpisodeAborted`, :class:`GenerateBroken`.
The implementation is :mod:`rollstream.producer.session`.
"""

from __future__ import annotations

import abc
import dataclasses
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias

from rollstream.common.errors import EpisodeAborted, GenerateBroken
from rollstream.common.models import PromptContent, Sample, Status

__all__ = [  # the stable names above (the two errors are defined in common.errors, the one tree)
    "Episode",
    "EpisodeAborted",
    "EpisodeInfo",
    "GenerateBroken",
    "GenerateFunction",
    "GenerateResult",
    "SamplingParams",
    "Trajectory",
    "Turn",
]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A copy of the producer's sampling parameters for one engine call (change with :meth:`replace`)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Other engine sampling parameters passed through as they are (``stop``, ``top_k``, ...)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def engine_params(self) -> dict[str, Any]:
        """The engine's sampling parameters, without the length limit."""
        return {"temperature": self.temperature, "top_p": self.top_p, **self.extra}

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes``; unknown names go into :attr:`extra` (``stop=["</tool>"]``)."""
        known = {f.name for f in dataclasses.fields(self)}
        extra = dict(self.extra)
        extra.update({k: v for k, v in changes.items() if k not in known})
        mine = {k: v for k, v in changes.items() if k in known}
        if "extra" in mine:
            extra.update(mine.pop("extra"))
        return dataclasses.replace(self, extra=extra, **mine)


@dataclass(frozen=True, slots=True)
class EpisodeInfo:
    """What the producer knows of an episode before it starts (frozen)."""

    index: int
    """The prompt's index (the group's)."""
    epoch: int
    attempt: int
    """0 for the first attempt; recycled attempts count up to ``max_attempts``."""
    member: int
    """This episode's position in its group, ``0 .. n-1`` (the ``Sample.index`` of its samples)."""
    n: int
    """Episodes per group (the namespace's ``n_samples_per_prompt``)."""
    prompt: PromptContent
    """The dataset's prompt: a string or a list of chat messages."""
    label: Any
    metadata: Mapping[str, Any]
    prompt_ids: tuple[int, ...] | None
    """The prompt's token ids (feeder, tokenizer or the engine's ``/tokenize``), None when unknown."""
    admitted_version: int
    """The trainer's weight version when the prompt was admitted."""
    deadline: float | None
    """``time.monotonic()`` past which the episode is cancelled and FAILED; None: no deadline."""
    sampling: SamplingParams
    partial: Sample | None = None
    """With partial rollout, this member's sample of an earlier attempt that was ABORTED or drained
    (the default rollout continues it); None otherwise."""


@dataclass(frozen=True, slots=True)
class Turn:
    """What one :meth:`Trajectory.generate` (or :meth:`Episode.complete`) brought back."""

    text: str
    token_ids: array[int]
    log_probs: array[float] | None
    finish_reason: str | None
    """``stop``, ``length`` (max_new_tokens or the context budget), ...; never ``abort``."""
    weight_versions: tuple[int, ...]
    """The weight version of every engine call of this turn (two or more when continued after an abort)."""
    weight_version_spans: tuple[tuple[int, int, int], ...] = ()
    """``(start, end, version)`` over :attr:`token_ids` (end exclusive), one per engine call."""

    @property
    def status(self) -> Status:
        return Status.from_finish_reason(self.finish_reason)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class Trajectory(abc.ABC):
    """One token sequence being built (one Sample): prompt ids, then model and tool tokens."""

    @property
    @abc.abstractmethod
    def sample(self) -> Sample:
        """A snapshot of the sample so far (``tokens``, ``loss_mask``, ``rollout_log_probs``,
        versions aligned; its own arrays, so later turns do not change it)."""

    @property
    def response_length(self) -> int:
        """Tokens after the prompt so far (model and tool tokens): ``sample.response_length``
        without building a snapshot."""
        return self.sample.response_length

    @property
    @abc.abstractmethod
    def room(self) -> int | None:
        """Tokens left under the context budget (``--max-context``); None without a budget."""

    @abc.abstractmethod
    async def generate(
        self, *, max_new_tokens: int | None = None, sampling: SamplingParams | None = None, **params: Any
    ) -> Turn:
        """Ask an engine to continue this trajectory; append its tokens (mask 1) and log-probs.

        ``sampling`` replaces the episode's parameters, ``params`` change single ones
        (``stop=["</tool>"]``); ``max_new_tokens`` is clamped to :attr:`room`. With no room left,
        nothing is sent and an empty turn with ``finish_reason="length"`` comes back."""

    @abc.abstractmethod
    async def observe(self, content: str | Sequence[int]) -> int:
        """Append tool/environment tokens (text is tokenized): loss mask 0, log-prob 0. Returns
        how many tokens were appended (clamped to :attr:`room`)."""


class Episode(Trajectory):
    """One group member's episode: its main :class:`Trajectory` plus everything around it."""

    @property
    @abc.abstractmethod
    def info(self) -> EpisodeInfo:
        """The frozen facts (prompt, label, metadata, n, member, version, deadline, sampling)."""

    @property
    def prompt(self) -> PromptContent:
        return self.info.prompt

    @property
    def label(self) -> Any:
        return self.info.label

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.info.metadata

    @property
    def n(self) -> int:
        return self.info.n

    @property
    def member(self) -> int:
        return self.info.member

    @property
    def admitted_version(self) -> int:
        return self.info.admitted_version

    @property
    def deadline(self) -> float | None:
        return self.info.deadline

    @property
    def sampling(self) -> SamplingParams:
        return self.info.sampling

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The producer's tokenizer object (``--tokenizer``), or None (then use :meth:`tokenize`)."""

    @abc.abstractmethod
    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``: the local tokenizer, else the engine's ``/tokenize``."""

    @abc.abstractmethod
    def limit(self, name: str) -> AbstractAsyncContextManager[None]:
        """Hold one unit of the named limit ``name`` while inside: the producer-wide one
        (``--limit name=K``) and the namespace-wide one (``rollstream init --limit name=K``,
        ``rollstream limits set``, leased across every producer), both when both are set.
        Waiting holds no engine slot and counts against the episode deadline; an unknown name
        raises ``KeyError`` (the sample fails)."""

    async def prepared(self) -> Any:
        """The result of the generate function's ``prepare(info)`` hook for this episode (warm
        pools, :mod:`.warm`), awaited if it still runs; None without a hook. Taking it keeps it
        from being released."""
        return None

    async def rate(self, name: str) -> None:
        """Take one token of the namespace rate ``name`` (``rollstream init --rate name=R/s``),
        waiting for it; a bucket shared by every producer. ``KeyError`` for an unknown name."""
        raise KeyError(f"no namespace rate named {name!r} here")

    async def once(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` (sync or async) once per episode: with durable episodes its result is
        journaled, and a resumed episode gets it back instead of running ``fn`` again (a paid API
        call, a sandbox that must not be created twice). The result must be msgpack-encodable.
        Without durable episodes it simply runs ``fn``."""
        result = fn()
        return await result if isinstance(result, Awaitable) else result

    @abc.abstractmethod
    async def segment(self, prompt: str | Sequence[int]) -> Trajectory:
        """Another trajectory of this episode (another agent, a summarised context), starting
        from ``prompt`` (text or ids); return its ``.sample`` in the list to publish it."""

    @abc.abstractmethod
    async def complete(
        self, input_ids: Sequence[int], *, max_new_tokens: int | None = None,
        sampling: SamplingParams | None = None, **params: Any,
    ) -> Turn:
        """One token-in/token-out engine call that appends nothing (for adapters that keep their
        own sample): same capacity, deadlines, retries and abort handling as :meth:`generate`."""


GenerateResult: TypeAlias = "Sample | Sequence[Sample]"
GenerateFunction = Callable[[Episode], Awaitable[GenerateResult]]
"""``async def generate(episode) -> Sample | list[Sample]``. A callable object that also has an
``async def aclose()`` (the slime/miles/OpenAI adapters: their endpoint server) is closed when
the producer exits (:meth:`rollstream.producer.rollout.Rollout.aclose`)."""
