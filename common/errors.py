"""The exception hierarchy of rollstream.

Every error rollstream raises on purpose derives from :class:`RollstreamError`::

    RollstreamError
    ├── ConfigError (also ValueError)         bad or inconsistent configuration (every argument check)
    │   ├── NamespaceNotInitialized           `rollstream init` was never run for the namespace
    │   ├── NamespaceGone                     its streams or consumer groups vanished under a running process
    │   │   └── RedisDataLost                 ... because Redis restarted without persistence
    │   ├── ConsumerNameInUse                 another live trainer holds this consumer name
    │   ├── RedisPermissionDenied             the Redis ACL user lacks a command (NOPERM), naming the role
    │   └── ExtraNotInstalled                 a feature needs an optional extra (`pip install 'rollstream[X]'`)
    ├── RedisOutOfMemory                      Redis refused a write at ``maxmemory``: transient, backed off
    ├── PayloadError                          the payload store failed on one object (store URL and key named)
    │   ├── PayloadMissing                    the object is gone (file deleted, store process died): recycled
    │   ├── PayloadCorrupt                    its size or checksum is not what its entry says: recycled
    │   ├── PayloadUnreadable                 the store cannot be reached or refused the read: recycled
    │   ├── PayloadStoreFull                  the store has no room for a put: transient, backed off
    │   └── PayloadNotFetched                 an offloaded array or text read before its batch fetched it: fetch first
    ├── DecodeError (also ValueError)         a payload that is not a valid rollstream entry
    ├── RowError (also ValueError)            a dataset row that cannot be fed (file and row named): dead-lettered
    ├── ArchiveUnusable                       an archive folder or file that cannot be written or read (full disk,
    │                                         read-only, not a folder, a corrupt file): the path and the fix named
    ├── EngineError                           the engines failed after the retries (or none is usable): fatal
    │   └── EngineBroken                      no usable reply on many distinct prompts in a row: fatal
    ├── EngineRejected                        one request cannot be served, not retried: the sample fails
    │   ├── EngineReplyInvalid                the engine answered, but nothing usable (malformed, too large, too slow)
    │   └── PromptNotSupported                the producer's setup cannot send this prompt (no engine was asked)
    ├── EpisodeAborted                        an engine call was aborted (weight update), partial rollout off:
    │                                         the episode is recycled whole (not the prompt's fault)
    ├── EpisodeDrained                        a drain stopped a durable episode at a step: resumed elsewhere
    ├── WeightSyncError                       an engine failed a stage of the trainer's weight update
    ├── RewardError                           the reward function failed: the group fails
    │   └── RewardBroken                      ... on many distinct prompts in a row, or its threads hang: fatal
    ├── GenerateError                         the rollout plug-in (``--generate``) failed: the sample fails
    │   ├── InvalidResult (also ValueError)   what it returned cannot be published
    │   ├── EndpointRefused (also ValueError) its request to the episode's endpoint was refused
    │   │   └── ConversationDiverged          a chat request that does not extend the recorded conversation
    │   └── GenerateBroken                    it failed on many distinct prompts in a row: fatal
    └── PipelineError                         raised by ``take()`` instead of hanging
        ├── ProducerFailed                    a producer recorded a fatal error (remote traceback)
        ├── PipelineStalled                   no producer has been alive for too long
        │   └── AllGroupsStale                every group read for too long was recycled as stale
        └── ReplayExhausted                   an archive replay handed out its last recorded batch

Each node is one thing the caller does, and no class has two parents in the tree (the ``also
ValueError`` ones are ``ValueError`` for argument checks only), so a handler is one ``except``
per node: ``EngineError`` stops the producer, ``EngineRejected`` fails the sample,
``EpisodeAborted`` recycles the episode, in any order.

What a user meets where: ``ConfigError`` at start (bad flags, specs, settings); the "sample fails"
errors become a FAILED sample with the message in ``Sample.error`` (the group is recycled with
``attempt + 1`` and dead-lettered after ``max_attempts``); the "fatal" ones stop the producer,
are recorded in ``events`` and reach the trainer as ``ProducerFailed``. Each class is defined
here, once; the modules that raise them re-export them where they were first defined
(``rollstream.producer.rewards.RewardBroken``, ``rollstream.producer.engine.EngineReplyInvalid``...).
A new error goes here, under the node that says what the caller does with it.

Redis connection problems surface as redis-py's own ``redis.exceptions.ConnectionError``;
the long-running loops retry them with bounded backoff, and ``RedisOutOfMemory`` too.
"""

from __future__ import annotations


class RollstreamError(Exception):
    """Root of every error raised by rollstream."""


class ConfigError(RollstreamError, ValueError):
    """Configuration that is invalid, or inconsistent with the namespace's."""


class NamespaceNotInitialized(ConfigError):
    """The namespace has no config in Redis."""

    def __init__(self, namespace: str) -> None:
        super().__init__(
            f"namespace {namespace!r} has no config in Redis: run "
            f"`rollstream init --ns {namespace} --n-samples N --batch-size B` first"
        )
        self.namespace = namespace


class ConsumerNameInUse(ConfigError):
    """Another live trainer holds this consumer name (two would train the same groups)."""

    def __init__(self, namespace: str, name: str, holder: str | None, detail: str) -> None:
        super().__init__(
            f"consumer name {name!r} of namespace {namespace!r} is held by another live trainer "
            f"({holder or 'holder unknown'}): {detail}. Stop that trainer, or use another name "
            f"(a crashed trainer's hold expires by itself)"
        )
        self.namespace = namespace
        self.name = name
        self.holder = holder


class NamespaceGone(ConfigError):
    """The namespace's streams or consumer groups vanished under a running process (NOGROUP)."""


class RedisDataLost(NamespaceGone):
    """Redis restarted since this process connected and came back without the namespace."""


class RedisPermissionDenied(ConfigError):
    """The Redis ACL user may not run a command rollstream needs (NOPERM, also inside a script):
    a deployment error, never retried. ``roles`` are the roles of
    ``deploy/redis/users.acl.template`` that grant ``command``."""

    def __init__(self, message: str, *, command: str, user: str, roles: tuple[str, ...]) -> None:
        super().__init__(message)
        self.command = command
        self.user = user
        self.roles = roles


class RedisOutOfMemory(RollstreamError):
    """Redis refused a write because ``used_memory`` reached ``maxmemory`` (OOM, also inside a
    script, which then changed nothing). Transient: the loops back off until memory is freed."""


class ExtraNotInstalled(ConfigError):
    """A feature was asked for whose optional dependencies (an install extra) are missing."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        super().__init__(f"{purpose} needs {module!r}: pip install 'rollstream[{extra}]'")
        self.module = module
        self.extra = extra


class PayloadError(RollstreamError):
    """The payload store (``rollstream init --payload-store``) failed on one object; the message
    names the store (its redacted URL) and the key."""

    def __init__(self, store: str, key: str, detail: str) -> None:
        super().__init__(f"payload store {store}: object {key!r}: {detail}")
        self.store = store
        self.key = key
        self.detail = detail


class PayloadMissing(PayloadError):
    """The object is not in the store (its file was deleted, the store process holding it died).
    A group whose object is missing is recycled with this message, never trained short."""


class PayloadCorrupt(PayloadError):
    """The object's size or checksum is not what its group's entry recorded. Recycled likewise."""


class PayloadUnreadable(PayloadError):
    """The store could not be reached or refused the read (down, timed out, an I/O error)."""


class PayloadStoreFull(PayloadError):
    """The store has no room for a put (``ENOSPC``, Mooncake out of segment memory). Transient:
    the producer's partial objects are removed, it backs off and retries, loudly."""


class PayloadNotFetched(PayloadError):
    """A sample's array or text is still in the payload store (an :class:`~.arrays.Unfetched` or
    :class:`~.arrays.UnfetchedText` placeholder: its length is known, its values are not) and
    something read its values (a ``keep`` filter doing so is run again after a fetch): fetch the
    batch first (``await batch.fetch()``, ``batch.fetch_now()``, any numpy view of the batch, or
    ``batch.shard(rank, world_size)`` then its fetch). The caller's mistake, not the store's."""

    def __init__(self, key: str, detail: str) -> None:
        RollstreamError.__init__(self, f"payload object {key!r}: {detail}")
        self.store = ""
        self.key = key
        self.detail = detail


class RowError(RollstreamError, ValueError):
    """A dataset row that cannot become a prompt; the message names the file and row. The feeder
    dead-letters it with that reason (a whole-file load raises ``ConfigError`` instead)."""


class ArchiveUnusable(RollstreamError):
    """The archive folder or one of its files cannot be written or read: a full disk, a read-only
    or missing folder, a file where a folder should be, a corrupt part file. The message names the
    path and what to do; the archiver stops on it (it never writes past a file it could not)."""


class DecodeError(RollstreamError, ValueError):
    """A stream entry or payload that cannot be decoded; ``reason`` is a short slug."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class EngineError(RollstreamError):
    """The engines failed after all retries, or no engine stayed usable: fatal for the producer."""


class EngineBroken(EngineError):
    """An engine (or every engine) answered nothing usable on many distinct prompts in a row:
    the engine is broken, not the prompts. Fatal for the producer, like a broken reward."""

    def __init__(self, engine: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.engine = engine
        self.reason = reason


class EngineRejected(RollstreamError):
    """One request cannot be served and retrying cannot help: the engine answered with a client
    error (4xx other than 429), or (subclasses) an unusable reply or a prompt that cannot be sent.
    The sample fails; a run of them on distinct prompts becomes :class:`EngineBroken`."""

    def __init__(self, status_code: int, body: str) -> None:
        super().__init__(f"engine rejected the request with HTTP {status_code}: {body[:500]}")
        self.status_code = status_code
        self.body = body
        self.engine = ""
        """The engine's URL (set by the client), so a run of refusals can be blamed on one engine."""


class PromptNotSupported(EngineRejected):
    """A prompt this producer's configuration cannot send (e.g. chat messages to SGLang without a
    tokenizer): decided locally, no engine was asked. Its samples fail and the prompt is recycled
    exactly as after an engine's 400 (status 400), and it is never blamed on an engine."""

    def __init__(self, detail: str) -> None:
        RollstreamError.__init__(self, f"prompt not supported by this producer's configuration: {detail}")
        self.status_code = 400
        self.body = detail
        self.engine = ""


class EngineReplyInvalid(EngineRejected):
    """The engine answered, but the reply cannot be used (malformed, too large, too slow).

    ``reason`` is a short slug (``not_json``, ``schema``, ``no_logprobs``, ``count_mismatch``,
    ``non_finite_logprob``, ``choices``, ``spans``, ``version``, ``too_large``, ``deadline``); ``detail`` says more.
    Not retried: the producer turns it into a FAILED sample with this message."""

    def __init__(self, reason: str, detail: str, where: str = "") -> None:
        RollstreamError.__init__(self, f"invalid engine reply{f' from {where}' if where else ''}: {reason}: {detail}")
        self.status_code = 200
        self.body = detail
        self.reason = reason
        self.detail = detail
        self.where = where
        self.engine = ""


class EpisodeAborted(RollstreamError):
    """An engine call was aborted (a weight update) with partial rollout off: the episode is
    recycled whole. Raised out of ``Trajectory.generate``; user code
    should let it pass (it is no ``EngineError``, so ``except EngineError`` does not swallow it)."""


class EpisodeDrained(RollstreamError):
    """A draining producer stopped a durable episode at a step boundary: its prompt goes back
    with its journal, and the producer that takes it over resumes it. User code should let it
    pass (the session remembers if it is caught)."""


class WeightSyncError(RollstreamError):
    """An engine failed a stage of the weight update; ``engine``, ``stage`` and ``detail`` say how."""

    def __init__(self, engine: str, stage: str, detail: str) -> None:
        super().__init__(f"weight update: engine {engine} failed at {stage}: {detail}")
        self.engine = engine
        self.stage = stage
        self.detail = detail


class RewardError(RollstreamError):
    """The reward function raised or returned something unusable."""


class RewardBroken(RewardError):
    """The reward function cannot be used any more (not one prompt's problem): fatal."""


class GenerateError(RollstreamError):
    """The rollout plug-in (the generate function) failed on one episode: its sample fails."""


class InvalidResult(GenerateError, ValueError):
    """What a generate function returned cannot be published; the message says why."""


class EndpointRefused(GenerateError, ValueError):
    """A request to an episode endpoint was refused; the sample fails with this message."""


class ConversationDiverged(EndpointRefused):
    """A chat request does not extend the conversation recorded for the episode."""


class GenerateBroken(GenerateError):
    """The generate function failed on ``generate_failure_limit`` distinct prompts in a row
    (nothing succeeded in between): it is broken, not the prompts. Fatal for the producer."""


class PipelineError(RollstreamError):
    """The pipeline cannot deliver what ``take()`` waits for."""


class ProducerFailed(PipelineError):
    """A producer recorded a fatal error and no group arrived since."""

    def __init__(self, producer: str, error: str, traceback: str) -> None:
        super().__init__(
            f"producer {producer!r} failed: {error}\n--- remote traceback ---\n{traceback}"
        )
        self.producer = producer
        self.error = error
        self.remote_traceback = traceback


class PipelineStalled(PipelineError):
    """No producer has sent a heartbeat for longer than the stall timeout."""


class AllGroupsStale(PipelineStalled):
    """Every group ``take()`` read for longer than its stall timeout was recycled as stale, none
    usable: the engines are not getting the trainer's weights (or generation outlasts them)."""


class ReplayExhausted(PipelineError):
    """``ArchiveReplay.take()`` after the last recorded batch: the replayed run is over."""
