"""The one rule for a prompt's attempts: why a group must be tried again, and when its prompt has
used up its attempts (DESIGN §4.7).

Two places apply it with the same text: the producer that built a group whose prompt is past
``max_attempts`` dead-letters it instead of publishing it (so the backlog never holds a group no
``take()`` will accept, issue 32), and ``take()``'s :func:`~rollstream.consumer.verdict.judge`
keeps the check as the second line (groups from producers of an earlier build).

An abort the pipeline caused (a weight update paused the engines while the attempt ran: the
producer marks its ABORTED samples with :data:`WEIGHT_UPDATE_ABORT`) is recycled and written in
the prompt's history, but keeps the attempt, as a stale recycle does (DESIGN §4.7, §4.13, §4.17):
only the prompt's own failures count towards ``max_attempts``.
"""

from __future__ import annotations

from .config import PipelineConfig
from .models import Group, Prompt, Status, retry_prompt

MAX_ERRORS_TEXT = 300
"""Characters of a failed group's sample errors kept in the reason."""
WEIGHT_UPDATE_ABORT = "aborted by a weight update"
"""``Sample.error`` of an ABORTED sample whose attempt saw the pipeline pause or its weights
change: the pipeline's cadence, not the prompt's fault."""
WEIGHT_UPDATE_REASON = "weight_update: aborted by a weight update (the pipeline's cadence; attempt kept)"
"""The history line of such a recycle."""


def by_weight_update(group: Group) -> bool:
    """Whether ``group`` is ABORTED and every aborted sample was aborted by a weight update."""
    if group.status != Status.ABORTED:
        return False
    return all(s.error == WEIGHT_UPDATE_ABORT for s in group.samples if s.status == Status.ABORTED)


def mark_weight_update(group: Group) -> None:
    """Mark the ABORTED samples of ``group`` as aborted by a weight update (the producer, when
    the pipeline paused or the weights changed during the attempt)."""
    for sample in group.samples:
        if sample.status == Status.ABORTED:
            sample.error = WEIGHT_UPDATE_ABORT


def failure_reason(group: Group) -> str | None:
    """Why ``group`` cannot be trained and its prompt is tried again with ``attempt + 1``: any
    FAILED sample (``failed: <the distinct errors>``), else any ABORTED one (``aborted``, or
    :data:`WEIGHT_UPDATE_REASON` when a weight update aborted it); None when neither (stale and
    filtered groups are judged by the consumer alone)."""
    status = group.status
    if status == Status.FAILED:
        errors = {s.error or "failed" for s in group.samples if s.status == Status.FAILED}
        return f"failed: {'; '.join(sorted(errors))[:MAX_ERRORS_TEXT]}"
    if status == Status.ABORTED:
        return WEIGHT_UPDATE_REASON if by_weight_update(group) else "aborted"
    return None


def past_max_attempts(attempt: int, config: PipelineConfig, last: str) -> str | None:
    """The dead letter's reason when a prompt's next ``attempt`` is past ``max_attempts``
    (``last``: the reason of the attempt that just ended), else None."""
    if attempt <= config.max_attempts:
        return None
    return f"max_attempts: recycled {attempt} times (> {config.max_attempts}); last: {last}"


def exhausted(group: Group, config: PipelineConfig) -> tuple[str, Prompt] | None:
    """``(reason, prompt)`` when ``group`` can never be trained: it failed (or was aborted) and
    its prompt has no attempt left; ``prompt`` is what the dead letter holds (its next attempt,
    as ``rollstream dead requeue`` puts it back). None when the group is usable or retried."""
    reason = failure_reason(group)
    if reason is None:
        return None
    if reason == WEIGHT_UPDATE_REASON:
        return None  # the pipeline's doing: the attempt is kept, the prompt is never dead for it
    keep_partial = group.status == Status.ABORTED and config.partial_rollout
    prompt = retry_prompt(group, reason, keep_partial=keep_partial)
    dead = past_max_attempts(prompt.attempt, config, reason)
    return None if dead is None else (dead, prompt)
