"""What becomes of a group entry ``take()`` reads: the one pure rule, :func:`judge`.

In the order it is checked:

* undecodable, wrong sample count, over the size limits -> dead-letter stream, with the reason;
* ABORTED by a weight update (:func:`~rollstream.common.attempts.by_weight_update`) -> prompt
  recycled with its attempt unchanged (the pipeline's cadence is not the prompt's fault), counted
  in ``recycled_weight_update``, never dead-lettered for it;
* any FAILED or ABORTED sample -> prompt recycled (``attempt + 1``, state reset, or with
  partial rollout the partial samples kept); past ``max_attempts`` -> dead-letter stream (the
  rule of :mod:`rollstream.common.attempts`, which the producer applies first: such a group is
  dead-lettered where it was built, so this is the second line);
* staleness (trainer version - oldest sample version) above the limit -> recycled with its
  attempt unchanged (staleness is not the prompt's fault); a prompt recycled as stale
  :data:`MAX_STALE_RECYCLES` times in a row while other groups were fresh -> dead-letter stream;
* rejected by the dynamic-sampling ``keep`` filter -> dropped and counted (or recycled, with
  ``recycle_filtered``); a filter that reads what is still in the payload store (the text, token
  values: ``PayloadNotFetched``) is run again once the consumer has fetched the group (:func:`refilter`);
* else kept.

:func:`judge` does no I/O (the keep filter is the trainer's own function); the consumer carries
out the :class:`Verdict` (one Lua script per hand-back) and keeps the counts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollstream.common.attempts import WEIGHT_UPDATE_REASON, failure_reason, past_max_attempts
from rollstream.common.codec import DEFAULT_LIMITS, CodecLimits, decode_group_entry, prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import DecodeError, PayloadNotFetched
from rollstream.common.keys import StateField
from rollstream.common.models import Group, Prompt, Status, retry_prompt

from .filters import KeepFilter, rejection_reason

STALE_STREAK_MIN = 4
"""Groups recycled as stale in a row (and at least a batch of them) before ``take()`` reports
that everything goes stale."""
MAX_STALE_RECYCLES = 20
"""A prompt recycled as stale this many times in a row while other groups were fresh (its own
generation outlasts the staleness window) is dead-lettered; at most ``MAX_HISTORY``."""
ALL_STALE_MARK = " (all groups stale)"
"""Appended to a stale recycle's reason in the prompt's history when every group was going stale
(the pipeline's fault): those never count towards :data:`MAX_STALE_RECYCLES`."""


class Cause(enum.StrEnum):
    """What the group is, as found by the checks (in their order)."""

    UNDECODABLE = "undecodable"
    WRONG_SIZE = "wrong_group_size"
    FAILED = "failed"
    ABORTED = "aborted"
    WEIGHT_UPDATE = "weight_update"
    """Aborted by a weight update: the pipeline's cadence, the attempt is kept."""
    STALE = "stale"
    PAYLOAD = "payload"
    """An object of the group could not be read from the payload store (missing, wrong size or
    checksum, store down): recycled with its attempt unchanged (the store's fault, not the
    prompt's), never trained short."""
    FILTERED = "filtered"
    USABLE = "usable"

    @property
    def fresh(self) -> bool:
        """Within the staleness limit: whatever went stale before, weights reach the engines."""
        return self in (Cause.FILTERED, Cause.USABLE)


class Route(enum.StrEnum):
    """Where the entry goes."""

    KEEP = "keep"
    """Into the batch."""
    RECYCLE = "recycle"
    """Its prompt back to the retry stream (``Verdict.fields``)."""
    DROP = "drop"
    """Acknowledged and counted as filtered (``StateField.filtered(reason)``)."""
    DEAD_LETTER = "dead_letter"
    """To the dead-letter stream with ``Verdict.reason`` (``Verdict.fields``: a prompt, or the raw
    entry when it cannot be decoded)."""


RECYCLE_COUNTERS = {
    Cause.ABORTED: StateField.RECYCLED_ABORTED,
    Cause.WEIGHT_UPDATE: StateField.RECYCLED_WEIGHT_UPDATE,
    Cause.STALE: StateField.RECYCLED_STALE,
    Cause.FAILED: StateField.RECYCLED_FAILED,
    Cause.FILTERED: StateField.RECYCLED_FILTERED,
    Cause.PAYLOAD: StateField.RECYCLED_PAYLOAD,
}
"""Why a group is recycled -> its counter in the state hash (also its ``recycled_*`` metric)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """:func:`judge`'s answer for one entry."""

    cause: Cause
    route: Route
    reason: str = ""
    """Why (the recycle's history line, the dead letter's reason, the filter's reason for a drop)."""
    group: Group | None = None
    """The decoded group (None when undecodable)."""
    fields: Mapping[Any, Any] | None = None
    """What a recycle or dead letter writes."""
    prompt: Prompt | None = None
    """The prompt's next attempt, for a recycle or a dead letter of a decoded group."""
    staleness: int | None = None
    """The group's staleness (None when not decoded or of the wrong size)."""
    rejection: str | None = None
    """The keep filter's reason when it rejected the group (whatever the route)."""
    filter_after_fetch: bool = False
    """Kept so far, but the keep filter read what is still in the payload store (it raised
    ``PayloadNotFetched``): the consumer fetches the group and judges it again (:func:`refilter`)."""


@dataclass(frozen=True, slots=True)
class StaleContext:
    """What the verdict on a stale group depends on besides the group: the consumer's streak."""

    fresh_seen: bool = False
    """A group within the staleness limit has been read since the consumer connected."""
    streak: int = 0
    """Groups recycled as stale in a row before this one (across takes)."""


def stale_reportable(streak: int, batch_size: int) -> bool:
    """A streak long enough to be reported: a whole batch's worth of groups (at least
    :data:`STALE_STREAK_MIN`), all stale."""
    return streak >= max(batch_size, STALE_STREAK_MIN)


def _stale_alone(reason: str) -> bool:
    return reason.startswith("stale:") and not reason.endswith(ALL_STALE_MARK)


def judge(
    fields: Mapping[bytes, bytes],
    config: PipelineConfig,
    *,
    version: int,
    staleness_limit: int | None,
    keep: KeepFilter | None = None,
    limits: CodecLimits = DEFAULT_LIMITS,
    stale: StaleContext = StaleContext(),
) -> Verdict:
    """The verdict on one group entry's ``fields`` for a trainer at weight ``version``."""
    try:
        group = decode_group_entry(fields, limits, views=True)
    except DecodeError as exc:
        return Verdict(Cause.UNDECODABLE, Route.DEAD_LETTER, f"{exc.reason}: {exc.detail}", fields=fields)
    size_error = group.size_error(config.n_samples_per_prompt)
    if size_error is not None:
        reason = f"wrong_group_size: {size_error}"
        # dead letters hold prompts: what `rollstream dead requeue` puts back
        prompt = retry_prompt(group, reason)
        return Verdict(Cause.WRONG_SIZE, Route.DEAD_LETTER, reason, group, prompt_fields(prompt), prompt)
    staleness = group.staleness(version, config.staleness_rule)
    failure = failure_reason(group)
    if failure is not None:
        if group.status == Status.FAILED:
            cause = Cause.FAILED
        else:
            cause = Cause.WEIGHT_UPDATE if failure == WEIGHT_UPDATE_REASON else Cause.ABORTED
        return _recycle(group, cause, failure, config, staleness, stale)
    if staleness_limit is not None and staleness > staleness_limit:
        reason = f"{Cause.STALE}: staleness {staleness} > {staleness_limit}"
        return _recycle(group, Cause.STALE, reason, config, staleness, stale)
    if keep is not None:
        try:
            rejection = rejection_reason(keep(group))
        except PayloadNotFetched:
            if group.payload is None or group.payload.attached:
                raise
            return Verdict(Cause.USABLE, Route.KEEP, group=group, staleness=staleness, filter_after_fetch=True)
        return _filtered(group, rejection, config, staleness, stale)
    return Verdict(Cause.USABLE, Route.KEEP, group=group, staleness=staleness)


def refilter(
    verdict: Verdict, keep: KeepFilter, config: PipelineConfig, stale: StaleContext = StaleContext()
) -> Verdict:
    """The verdict on a group whose keep filter read what was in the payload store
    (``verdict.filter_after_fetch``), judged again once the consumer has fetched it: the filter
    runs a second time, now on the values."""
    group = verdict.group
    if group is None:
        raise ValueError("refilter needs a decoded group")
    return _filtered(group, rejection_reason(keep(group)), config, verdict.staleness or 0, stale)


def _filtered(
    group: Group, rejection: str | None, config: PipelineConfig, staleness: int, stale: StaleContext
) -> Verdict:
    if rejection is not None:
        if config.recycle_filtered:
            reason = f"{Cause.FILTERED}: {rejection}"
            return _recycle(group, Cause.FILTERED, reason, config, staleness, stale, rejection)
        return Verdict(Cause.FILTERED, Route.DROP, rejection, group, staleness=staleness, rejection=rejection)
    return Verdict(Cause.USABLE, Route.KEEP, group=group, staleness=staleness)


def unreadable(group: Group, reason: str, config: PipelineConfig, staleness: int) -> Verdict:
    """The verdict on a kept group whose payload objects cannot be read: recycled (generated
    again, which puts new objects) with ``reason`` (``payload: <store and key>: <why>``), its
    attempt unchanged: never dead-lettered for the store's failures."""
    return _recycle(group, Cause.PAYLOAD, reason, config, staleness, StaleContext())


def _recycle(
    group: Group,
    cause: Cause,
    reason: str,
    config: PipelineConfig,
    staleness: int,
    stale: StaleContext,
    rejection: str | None = None,
) -> Verdict:
    """Put the group's prompt back with ``attempt + 1`` (past max_attempts: dead-letter it);
    ``reason`` is the history line (``<cause>: <detail>``)."""
    keep_partial = cause in (Cause.ABORTED, Cause.WEIGHT_UPDATE) and config.partial_rollout
    # Staleness is the pipeline's doing, not the prompt's: it does not use up an attempt
    # (counted in recycled_stale; a pipeline where everything goes stale is diagnosed instead).
    # Nor does an abort by a weight update (counted in recycled_weight_update).
    is_stale = cause == Cause.STALE
    # An unreadable payload object is the store's fault, not the prompt's either: a store that
    # fails is loud (payload_read_failures, inspect), never drained into the dead-letter stream.
    cadence = is_stale or cause in (Cause.WEIGHT_UPDATE, Cause.PAYLOAD)
    # other groups are fresh (this one counts towards the streak)
    alone = is_stale and stale.fresh_seen and not stale_reportable(stale.streak + 1, config.batch_size)
    if is_stale and not alone:
        reason += ALL_STALE_MARK
    prompt = retry_prompt(group, reason, keep_partial=keep_partial, uses_attempt=not cadence)
    # partial samples whose arrays are in the payload store refer to the group's objects (the
    # prompt's ``refs``: MOVE keeps them held; the producer fetches them), never read here
    fields = prompt_fields(prompt)

    def verdict(route: Route, why: str) -> Verdict:
        return Verdict(cause, route, why, group, fields, prompt, staleness, rejection)

    recent = prompt.history[-MAX_STALE_RECYCLES:]
    if alone and len(recent) == MAX_STALE_RECYCLES and all(_stale_alone(h) for h in recent):
        # The one loop staleness can make for a prompt: its generation always outlasts the window.
        return verdict(Route.DEAD_LETTER, (
            f"stale_recycles: recycled as stale {MAX_STALE_RECYCLES} times in a row while other groups "
            f"were fresh: its generation outlasts max_staleness versions (raise max_staleness or lower "
            f"max_new_tokens); last: {reason}"
        ))
    dead = None if cadence else past_max_attempts(prompt.attempt, config, reason)
    if dead is not None:
        return verdict(Route.DEAD_LETTER, dead)
    return verdict(Route.RECYCLE, reason)
