"""Every Redis key, consumer-group and channel name of rollstream, in one place.

All keys of one namespace share the hash tag ``{ns}`` so that every Lua script touches a single
slot and the pipeline runs unchanged on Redis Cluster.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

PREFIX = "rollstream"
PRODUCERS_GROUP = "producers"
TRAINER_GROUP = "trainer"
EVENTS_MAXLEN = 1000
"""The events stream is a log, not work: it is the only stream trimmed (approximately)."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise ConfigError(
            f"invalid namespace {namespace!r}: use 1-64 characters from A-Z a-z 0-9 _ . -"
        )
    return namespace


@dataclass(frozen=True, slots=True)
class Keys:
    """The key names of one namespace."""

    namespace: str

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.namespace}}}"

    @property
    def prompts(self) -> str:
        """Stream of prompts waiting or in flight; consumer group ``producers``."""
        return f"{self.base}:prompts"

    @property
    def retry(self) -> str:
        """Stream of prompts that came back (recycled, returned, requeued); consumer group
        ``producers``; admitted before ``prompts``."""
        return f"{self.base}:retry"

    @property
    def groups(self) -> str:
        """Stream of completed groups; consumer group ``trainer``."""
        return f"{self.base}:groups"

    @property
    def dead(self) -> str:
        """Stream of entries that could not be used, each with a ``reason``."""
        return f"{self.base}:dead"

    @property
    def events(self) -> str:
        """Capped stream of producer lifecycle and error events."""
        return f"{self.base}:events"

    @property
    def config(self) -> str:
        """Hash: the namespace's pipeline config."""
        return f"{self.base}:config"

    @property
    def state(self) -> str:
        """Hash: weight version, paused flag, feeder cursor, counters."""
        return f"{self.base}:state"

    @property
    def group_bytes(self) -> str:
        """Hash: group entry id -> the size of its ``data`` (the byte budget's ledger, kept by the
        scripts that add and remove group entries)."""
        return f"{self.base}:group_bytes"

    @property
    def payload_intents(self) -> str:
        """Sorted set: a group's object set (its member, :func:`~.payload.refs.group_member`) ->
        deadline (ms), of objects a producer is putting and has not published yet (written before
        the put); past its deadline they are orphans (the producer died between put and publish)
        and the reclaim turn's sweep frees them. One member per group, whatever its sample count."""
        return f"{self.base}:payload:intents"

    @property
    def payload_held(self) -> str:
        """Hash: a group's object set (member) -> its bytes, of every object set an entry refers
        to (a group in the group stream, a dead letter, an archive record); PUBLISH turns an
        intent into a claim here."""
        return f"{self.base}:payload:held"

    @property
    def payload_refs(self) -> str:
        """Hash: group entry id -> its object set (member), of every entry of the group stream
        that refers to objects: written by PUBLISH, read and deleted by the fate script that takes
        the entry out (ACK_DELETE, MOVE), so no fate reads the entry itself back into Lua."""
        return f"{self.base}:payload:refs"

    @property
    def payload_free(self) -> str:
        """Sorted set: a group's object set (member) -> when it was queued, of objects nothing
        refers to any more (moved here by the script of the fate that released them); a later
        step deletes its keys from the store and removes the member only once the store confirmed
        every key gone."""
        return f"{self.base}:payload:free"

    @property
    def archive(self) -> str:
        """Stream: every group's fate (trained, filtered, recycled, dead-lettered) with a copy of its
        entry, added by the script that decided it while the namespace has an ``archive_bytes``
        budget; read and deleted by ``rollstream archive`` (``ops/archiver.py``), the oldest dropped and
        counted (``archive_dropped``) past the budget."""
        return f"{self.base}:archive"

    @property
    def rows(self) -> str:
        """Hash: per-row statistics for a curriculum (``init --row-stats K``), field
        ``<source>:<row>`` ("" source for an unnamed dataset) -> JSON ``{"t": groups finished,
        "r": mean rewards and "v": reward variances of the last K, "w": last version, "e": last
        epoch}``, kept by ROW_STATS when a group of the row is committed or filtered."""
        return f"{self.base}:rows"

    @property
    def rows_restoring(self) -> str:
        """Hash: a checkpoint's row statistics being written back (the integrations' load), renamed
        onto :attr:`rows` once complete so a half-restored hash is never read."""
        return f"{self.base}:rows_restoring"

    @property
    def sources(self) -> str:
        """Hash: the named sources (``rollstream feed NAME=PATH``), fields ``SourceField.of(name,
        kind)`` = ``<name>:<kind>``: the feeder's cursor (``epoch``, ``position``, ``dataset``,
        ``done``) and counters kept by the scripts (``fed``, ``published``, ``committed``,
        ``recycled``, ``lost``: dead-lettered or filtered, ``requeued``, ``returned``; ``backlog``:
        its groups in the group stream, ``flight``: its prompts admitted and not finished, both for
        ADMIT's per-source cap), plus the mix's carry baseline (``base:<name>``, ``base_set``)
        written by the trainer."""
        return f"{self.base}:sources"

    @property
    def eval_prompts(self) -> str:
        """Stream, group ``producers``: the eval lane's prompts (``GroupConsumer.evaluate``), admitted
        before every training prompt; their groups go to :attr:`eval_groups`, never to ``groups``."""
        return f"{self.base}:eval_prompts"

    @property
    def eval_groups(self) -> str:
        """Stream: finished eval groups (plain ``eval`` and ``step`` fields beside the group's), read
        and deleted by ``GroupConsumer.eval_results``."""
        return f"{self.base}:eval_groups"

    def eval_rows(self, name: str) -> str:
        """Hash: a running eval's collected groups, prompt index -> its compact row (JSON: each
        sample's reward, truncation, version, length; the step): ``eval_results`` folds groups in as
        they come (so ``eval_groups`` stays bounded) and the result is computed from these."""
        return f"{self.base}:eval_rows:{name}"

    @property
    def eval_submitting(self) -> str:
        """Hash: eval name -> ``written:digest`` while its prompts are being written (``evaluate``
        streams them in chunks; a submission cut short resumes from here: same name, same set)."""
        return f"{self.base}:eval_submitting"

    @property
    def evals(self) -> str:
        """Hash: eval name -> JSON (submitted, prompts, samples, max_new_tokens, step; the result once finished)."""
        return f"{self.base}:evals"

    @property
    def producers(self) -> str:
        """Hash: producer id -> JSON heartbeat."""
        return f"{self.base}:producers"

    @property
    def engines(self) -> str:
        """Hash: the engine registry, engine URL -> JSON ``{"state": "active" | "draining",
        "since_ms", "by"}`` (``rollstream engines``; producers with ``--engines-from-registry``)."""
        return f"{self.base}:engines"

    @property
    def weights(self) -> str:
        """Hash: where the trainer's current weights are, ``path``, ``version``, ``since_ms``
        (``WeightSync.update``, ``GroupConsumer.record_weights``; producers with
        ``--catch-up-engines`` load them into an engine that is behind)."""
        return f"{self.base}:weights"

    @property
    def control(self) -> str:
        """Pub/sub channel: pause, resume and version changes, so waiting producers wake at once."""
        return f"{self.base}:control"

    @property
    def rollout_flags(self) -> str:
        """Hash: the rollout settings of the run that owns the namespace (engine sampling, reward,
        tokenizer, concurrency), written by the slime/miles integration so ``rollstream produce``
        on another node reads them instead of having them copied by hand."""
        return f"{self.base}:rollout"

    def journal(self, consumer: str) -> str:
        """Hash: the slime/miles integration's checkpoint journal of one trainer consumer."""
        return f"{self.base}:journal:{consumer}"

    @property
    def journal_pattern(self) -> str:
        """SCAN MATCH pattern of every journal of the namespace (one per trainer consumer)."""
        return f"{self.base}:journal:*"

    def episode(self, index: int, epoch: int, eval_name: str | None = None) -> str:
        """Hash: the journal of one prompt's episodes (durable episodes): field ``M:S`` is member
        M's step S (msgpack), ``n:M`` its step count, ``bytes`` the total, ``stream`` and
        ``entry_id`` where its prompt's entry is (what the orphan sweep checks). Appended under
        the prompt attempt's lease, deleted with its publish or dead letter, kept when it is
        returned (a drain), so the producer that takes the prompt over replays it. An eval-lane
        prompt's (``eval_name``: its eval's name, '' when its entry names none) is
        ``episode:eval:<name>:<index>:<epoch>``: eval sets are numbered from 0 like a dataset, so
        they need a key space of their own (a name has no ':')."""
        if eval_name is None:
            return f"{self.base}:episode:{index}:{epoch}"
        return f"{self.base}:episode:eval:{eval_name}:{index}:{epoch}"

    def episode_lane(self, stream: str, fields: Mapping[Any, Any]) -> str | None:
        """The ``eval_name`` of :meth:`episode` for a prompt entry of ``stream``: in the eval lane its
        plain ``eval`` field ('' when missing or not a name, as an older consumer's entries), else
        None. The producer and MOVE derive a journal's key from the same field, so they agree."""
        if stream != self.eval_prompts:
            return None
        value = fields.get("eval", fields.get(b"eval"))
        name = value.decode("utf-8", "replace") if isinstance(value, bytes) else "" if value is None else str(value)
        return name if len(name) <= 200 and ":" not in name else ""

    @property
    def episode_pattern(self) -> str:
        """SCAN MATCH pattern of every episode journal of the namespace (the eval lane's too)."""
        return f"{self.base}:episode:*"

    @property
    def limits(self) -> str:
        """Hash: the namespace-wide limits and rates (``init --limit/--rate``, ``rollstream limits
        set``): ``limit:NAME`` -> units, ``rate:NAME`` -> tokens per second."""
        return f"{self.base}:limits"

    @property
    def limit_stats(self) -> str:
        """Hash: per limit ``acquired:NAME``, ``wait_ms:NAME``, ``peak:NAME`` (most holders at once);
        per rate ``taken:NAME``, ``rate_wait_ms:NAME`` (for inspect)."""
        return f"{self.base}:limit_stats"

    def limit_holders(self, name: str) -> str:
        """Sorted set: the holders of a namespace limit's units, scored by lease expiry (ms)."""
        return f"{self.base}:limit:{name}:holders"

    def limit_waiters(self, name: str) -> str:
        """Sorted set: the episodes waiting for a unit, scored by when their wait lapses (ms)."""
        return f"{self.base}:limit:{name}:waiters"

    def limit_queue(self, name: str) -> str:
        """Sorted set: the same waiters scored by when they started waiting (ms): units are granted
        in this order (a newcomer polling fast does not pass a long waiter)."""
        return f"{self.base}:limit:{name}:queue"

    def rate_bucket(self, name: str) -> str:
        """Hash: a namespace rate's token bucket, ``tokens`` and ``ts_ms`` (Redis' own clock)."""
        return f"{self.base}:rate:{name}"

    @property
    def work_streams(self) -> tuple[str, ...]:
        """The streams holding prompts and groups that are not finished yet (what ``inspect``'s
        ledger counts: fed + requeued - committed - filtered - dead-lettered entries must be there)."""
        return (self.retry, self.prompts, self.groups)

    @property
    def consumer_groups(self) -> tuple[tuple[str, str], ...]:
        """(stream, consumer group) of every work stream."""
        return ((self.retry, PRODUCERS_GROUP), (self.prompts, PRODUCERS_GROUP), (self.groups, TRAINER_GROUP))

    def consumer_lease(self, consumer: str) -> str:
        """String with a TTL: the token of the one live trainer holding a consumer name."""
        return f"{self.base}:lease:{consumer}"

    @property
    def feeder(self) -> str:
        """String with a TTL: the token (host, pid) of the live ``rollstream feed``, renewed while it
        feeds and deleted when it stops (``init --force`` refuses while it is there)."""
        return f"{self.base}:feeder"

    @property
    def archiver_lease(self) -> str:
        """String with a TTL: the token of the one live ``rollstream archive`` of the namespace."""
        return f"{self.base}:archiver"

    @property
    def per_consumer_patterns(self) -> tuple[str, ...]:
        """SCAN MATCH patterns of the keys not fixed by name: per trainer consumer (journals, name
        leases), per prompt (episode journals), per limit or rate (holders, waiters, buckets) and
        per running eval (its collected rows)."""
        return (self.journal_pattern, self.lease_pattern, self.episode_pattern, f"{self.base}:limit:*",
                f"{self.base}:rate:*", f"{self.base}:eval_rows:*")

    @property
    def lease_pattern(self) -> str:
        """SCAN MATCH pattern of every trainer consumer name lease of the namespace."""
        return f"{self.base}:lease:*"

    def all_keys(self) -> list[str]:
        """The fixed keys; the per-consumer ones are found with :attr:`per_consumer_patterns`."""
        return [
            self.prompts,
            self.retry,
            self.groups,
            self.dead,
            self.events,
            self.config,
            self.state,
            self.producers,
            self.engines,
            self.weights,
            self.rollout_flags,
            self.group_bytes,
            self.payload_intents,
            self.payload_held,
            self.payload_refs,
            self.payload_free,
            self.archive,
            self.sources,
            self.rows,
            self.limits,
            self.limit_stats,
            self.eval_prompts,
            self.eval_groups,
            self.evals,
            self.eval_submitting,
            self.archiver_lease,
            self.feeder,
        ]


ALIVE_STATES = ("starting", "running", "draining")
"""Producer states that count as alive while their heartbeat is fresh."""


NAMESPACE_SCAN_PATTERN = f"{PREFIX}:{{*}}:*"
"""SCAN MATCH pattern of every rollstream key of every namespace (read back with ``namespace_of``)."""


def namespace_of(key: str) -> str | None:
    """The namespace of a rollstream key, or None for a foreign key."""
    match = re.match(rf"^{PREFIX}:\{{([^}}]+)\}}:", key)
    return match.group(1) if match else None


class SourceField:
    """Field names of the ``sources`` hash."""

    KINDS = ("epoch", "position", "dataset", "done", "fed", "published", "committed", "recycled", "lost",
             "requeued")
    COUNTS = ("fed", "published", "committed", "recycled", "lost", "requeued")
    BASE_SET = "base_set"

    @staticmethod
    def of(name: str, kind: str) -> str:
        return f"{name}:{kind}"

    @staticmethod
    def base(name: str) -> str:
        return f"base:{name}"


class StateField:
    """Field names of the ``state`` hash (counters and trainer state)."""

    WEIGHT_VERSION = "weight_version"
    PAUSED = "paused"
    FEED_NEXT_INDEX = "feed_next_index"
    FEED_EPOCH = "feed_epoch"
    FEED_POSITION = "feed_position"
    FEED_DATASET = "feed_dataset"
    FED = "fed"
    ADMITTED = "admitted"
    PUBLISHED = "published"
    COMMITTED = "committed"
    RECYCLED_ABORTED = "recycled_aborted"
    """Groups recycled because the engine aborted a call, not a weight update: uses an attempt."""
    RECYCLED_WEIGHT_UPDATE = "recycled_weight_update"
    """Groups recycled because a weight update aborted a call: the attempt is kept (DESIGN §4.17)."""
    RECYCLED_STALE = "recycled_stale"
    RECYCLED_FAILED = "recycled_failed"
    RECYCLED_FILTERED = "recycled_filtered"
    FILTERED = "filtered"
    DEAD = "dead_lettered"
    DUPLICATES = "duplicates_discarded"
    RETURNED = "returned"
    CAP_BYPASSED = "source_cap_bypassed"
    """Prompts ADMIT read past a source's cap because nothing was in flight and nothing admissible."""
    PARKED = "parked"
    """Prompts ADMIT moved from the prompt stream to the end of the retry stream: a source at its
    share of ``max_backlog`` stood before the prompts of a source that is behind."""
    RECLAIMED = "reclaimed"
    LAST_PUBLISH_MS = "last_publish_ms"
    LAST_TAKE_MS = "last_take_ms"
    LAST_COMMIT_MS = "last_commit_ms"
    ADMISSION_BLOCKED_MS = "admission_blocked_ms"
    """Total time producers' admission was refused (paused, backlog, staleness), summed."""
    NAMESPACE_ID = "namespace_id"
    """A random id written by ``init`` to both the config and the state hash: a state hash without
    it (deleted, or Redis lost data) no longer holds the feeder cursor and counters of this namespace."""
    LAST_ADMIT_MS = "last_admit_ms"
    """When ADMIT last handed out a prompt."""
    VERSION_START_CONSUMED = "version_start_consumed"
    """Groups consumed (committed + taken) when the current weight version began."""
    PREV_VERSION_CONSUMED = "prev_version_consumed"
    """Groups consumed during the previous weight version (the measured cadence)."""
    RECLAIM_TURN_MS = "reclaim_turn_ms"
    """When a producer last took its turn to look for idle prompts (RECLAIM_TURN: one look per
    reclaim interval for the whole fleet)."""
    RECLAIM_DUE_MS = "reclaim_due_ms"
    """When a producer last found prompts idle past the lease: every producer takes over what it
    has room for when it sees a newer value."""
    REQUEUED = "requeued"
    """Dead-letter entries put back (into the retry stream) by an operator."""
    RELEASED = "released"
    """Groups of a gone trainer consumer moved back into the stream (``release-trainer``)."""
    STALE_STREAK = "stale_streak"
    """Groups a trainer recycled as stale in a row, none usable in between, when it last reported
    them (``take()``'s stale-recycling diagnosis; ``inspect`` shows it)."""
    STALE_SINCE_MS = "stale_since_ms"
    """When that streak began."""
    STALE_REPORTED_MS = "stale_reported_ms"
    """When it was last reported: unresolved while no ``take()`` returned after it."""
    STALE_ENGINE_OLDEST = "stale_engine_oldest"
    STALE_ENGINE_NEWEST = "stale_engine_newest"
    """The oldest and newest sample weight versions (the engines') of the streak's groups."""
    STALE_TRAINER_VERSION = "stale_trainer_version"
    """The trainer's weight version they were judged against."""
    STALE = (STALE_STREAK, STALE_SINCE_MS, STALE_REPORTED_MS, STALE_ENGINE_OLDEST, STALE_ENGINE_NEWEST,
             STALE_TRAINER_VERSION)
    GROUP_BYTES = "group_bytes"
    """Bytes of group data held in the group stream (ready and taken but not committed), kept
    atomically by PUBLISH and the scripts that remove groups: what the byte budget bounds."""
    PUBLISHED_BYTES = "published_bytes"
    """Bytes of group data ever published (with ``published``: the mean group size)."""
    EVAL_BYTES = "eval_bytes"
    """Bytes of group data held in ``eval_groups`` (the eval lane's own ledger, kept by PUBLISH and
    EVAL_COLLECT): ADMIT bounds the eval lane by it and ``max_backlog_bytes``, apart from training."""
    JOURNAL_BYTES = "journal_bytes"
    """Bytes held in episode journals (durable episodes), kept by the scripts that append to and
    delete them; with ``group_bytes`` it is what the byte budget bounds."""
    JOURNAL_STEPS = "journal_steps"
    """Episode steps ever journaled."""
    RESUME_DIVERGED = "resume_diverged"
    """Resumed episodes whose replay met a different request and went on live from that step."""
    JOURNALS_SWEPT = "journals_swept"
    """Orphan episode journals deleted by the reclaim turn's sweep (their prompt ended otherwise)."""
    JOURNAL_SWEEP_CURSOR = "journal_sweep_cursor"
    """The SCAN cursor where the next sweep of episode journals goes on (0: from the start)."""

    PAYLOAD_BYTES = "payload_bytes"
    """Bytes of the payload store's objects that entries refer to (``Keys.payload_held``'s sum),
    kept by PUBLISH and the fate scripts; also inside ``group_bytes`` for the groups' objects."""
    PAYLOAD_SWEPT = "payload_orphans_swept"
    """Object sets (one per group) freed by the sweep because no entry claimed them by their
    deadline (a producer that died between put and publish), or that no ledger knew (the full
    sweep)."""
    PAYLOAD_FREED = "payload_freed"
    """Objects the store confirmed deleted after their last reference went."""
    PAYLOAD_READ_FAILURES = "payload_read_failures"
    """Groups ``take()`` recycled because an object could not be read (missing, wrong size or
    checksum, store down)."""
    PAYLOAD_LAST_FAILURE = "payload_last_failure"
    """The last such failure's message (store and key named)."""
    RECYCLED_PAYLOAD = "recycled_payload"
    """Groups recycled because an object of theirs could not be read (also ``payload_read_failures``)."""

    ARCHIVE_BYTES = "archive_bytes"
    """Bytes of fate records held in the archive stream (what ``archive_bytes`` of the config bounds)."""
    ARCHIVE_RECORDED = "archive_recorded"
    """Fate records ever added to the archive stream."""
    ARCHIVE_DROPPED = "archive_dropped"
    """Fate records deleted unarchived to keep the archive stream under its budget (or larger than it)."""
    ARCHIVED = "archived"
    """Fate records written to Parquet by an archiver and deleted from Redis."""
    ARCHIVE_CURSOR = "archive_cursor"
    """The archive stream id of the last record an archiver wrote (its files are the truth)."""
    ARCHIVE_SEEN_MS = "archive_seen_ms"
    """When an archiver last confirmed records (or found none): its liveness for ``inspect``."""
    TRAINED_STEPS = "trained_steps"
    """Commits that acknowledged at least one group: a trained record's ``step``."""

    @staticmethod
    def filtered(reason: str) -> str:
        """The per-reason counter of groups rejected by the dynamic-sampling filter."""
        return f"{StateField.FILTERED_PREFIX}{reason}"

    FILTERED_PREFIX = "filtered:"
    LATE_GROUPS = "late_groups"
    """Groups trained later than admitted step + generation steps + 1 (``take()``, issue 38)."""
    LATE_PREFIX = "late:"
    """``late:<cause>``: the same by cause (weight_update, stale, aborted, failed, filtered, queued)."""
    BIAS_PREFIX = "bias:"
    """``bias:<epoch>:<dimension>:<bucket>:<kind>``: the bias ledger (``common/bias.py``)."""

    COUNTERS = (
        FED,
        ADMITTED,
        PUBLISHED,
        COMMITTED,
        RECYCLED_ABORTED,
        RECYCLED_WEIGHT_UPDATE,
        RECYCLED_STALE,
        RECYCLED_FAILED,
        RECYCLED_FILTERED,
        RECYCLED_PAYLOAD,
        FILTERED,
        DEAD,
        LATE_GROUPS,
        DUPLICATES,
        RETURNED,
        RECLAIMED,
    )

    INTEGERS = (
        *COUNTERS,
        WEIGHT_VERSION,
        PAUSED,
        FEED_NEXT_INDEX,
        FEED_EPOCH,
        FEED_POSITION,
        LAST_PUBLISH_MS,
        LAST_TAKE_MS,
        LAST_COMMIT_MS,
        ADMISSION_BLOCKED_MS,
        REQUEUED,
        RELEASED,
        LAST_ADMIT_MS,
        VERSION_START_CONSUMED,
        PREV_VERSION_CONSUMED,
        *STALE,
        RECLAIM_TURN_MS,
        RECLAIM_DUE_MS,
        GROUP_BYTES,
        PUBLISHED_BYTES,
        EVAL_BYTES,
        ARCHIVE_BYTES,
        ARCHIVE_RECORDED,
        ARCHIVE_DROPPED,
        ARCHIVED,
        ARCHIVE_SEEN_MS,
        TRAINED_STEPS,
        JOURNAL_BYTES,
        JOURNAL_STEPS,
        RESUME_DIVERGED,
        JOURNALS_SWEPT,
        JOURNAL_SWEEP_CURSOR,
        PAYLOAD_BYTES,
        PAYLOAD_SWEPT,
        PAYLOAD_FREED,
        PAYLOAD_READ_FAILURES,
    )
    """Fields that hold integers (with every ``filtered:<reason>`` counter): anything else there is damage."""
