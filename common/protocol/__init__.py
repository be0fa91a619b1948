"""The Redis protocol of one namespace: the commands on its keys and the shapes of its payloads.

The producer, the consumer and the operator tools talk to Redis through these classes, each
bound to one client and one namespace (``Cls(redis, keys, ...)``), so no caller hands a raw client
to a function; the atomic hand-overs themselves are the Lua scripts of ``common/scripts/``, each
bound by the class that runs it (:meth:`..lua.Script.bind`), which shapes its arguments and reply.

* :mod:`.prompts` :class:`PromptQueue`: a producer's side of the prompt streams (retry first):
  admit (under the namespace's config), renew leases, take over idle prompts, publish a group,
  return or dead-letter a prompt.
* :mod:`.groups` :class:`GroupQueue`: the trainer's side of the group stream; :class:`NameLease`:
  a trainer consumer name held by one live process.
* :mod:`.control` :class:`Control`: weight version and pause/resume, announced on ``control``.
* :mod:`.feed` :class:`Feed`: the feeder's cursor and the prompt stream it fills; :class:`Sources`:
  the named sources' hash and the rows' statistics.
* :mod:`.heartbeats` :class:`Heartbeats`: the ``producers`` hash; the pure model and the one fold
  (:class:`Heartbeat`, :func:`fold`, :class:`Fleet`) live in :mod:`..heartbeat`.
* :mod:`.keyspace` :class:`Keyspace`: a namespace's keys as a whole (list, delete, trainer names).
* :mod:`.stores` :class:`DeadLetters`, :class:`JournalHash`, :class:`RolloutFlagsHash`.
* :mod:`.evals` :class:`EvalLane`: eval sets submitted, their finished groups, their results.
* :mod:`.archive_stream` :class:`ArchiveStream`: the archive of fates, read and confirmed by the archiver.
* :mod:`.views` :class:`StreamView`: every read-only look ``inspect`` takes.
* :mod:`.trainer` :class:`TrainerMonitor`: what a ``take()`` reads and records, and the diagnosis
  of a waiting take, one round trip each (the consumer's).
* :mod:`.guard` :class:`Guarded`, the base of every namespace client: NOGROUP (the namespace was
  deleted, a consumer group destroyed; also raised inside a Lua script) becomes
  :class:`~..errors.NamespaceGone` naming the namespace, or :class:`~..errors.RedisDataLost` when
  Redis restarted without persistence since the first call; NOPERM becomes
  :class:`~..errors.RedisPermissionDenied` and OOM :class:`~..errors.RedisOutOfMemory`
  (:mod:`..redis_errors`). Every public coroutine method of a subclass is wrapped in that guard
  when its class is made, so no method can forget it; a client that never meets a consumer
  group (:class:`Heartbeats`, :class:`Keyspace`, :class:`Server`: INFO and SCAN) is
  :class:`Translated` (NOPERM and OOM only, no INFO before its first command).
"""

from ..heartbeat import Fleet, Heartbeat, Member, admission_refusals, fold, live_producers
from .archive_stream import ArchiveStream
from .control import TAKEN_MESSAGE, Control
from .engine_registry import EngineRegistry, RegistryEntry, check_engine_url
from .episodes import EpisodeJournals
from .evals import EvalLane
from .feed import Feed, FeedCursor, Sources, state_mismatch
from .groups import GroupQueue, NameLease
from .guard import Entry, Guarded, Server, Translated, flat_entries, is_nogroup, nogroup_error, raise_if_refused
from .heartbeats import Heartbeats
from .keyspace import Keyspace
from .limits import (
    LimitView,
    NamespaceLimits,
    format_rate,
    parse_limit,
    parse_limits,
    parse_limits_and_rates,
    parse_rate,
)
from .prompts import Admission, Admitted, PromptQueue
from .stores import DeadLetters, JournalHash, RolloutFlagsHash
from .trainer import Diagnosis, TakeStats, TrainerMonitor
from .views import StreamView

__all__ = [
    "TAKEN_MESSAGE",
    "Admission",
    "Admitted",
    "ArchiveStream",
    "Control",
    "DeadLetters",
    "Diagnosis",
    "EngineRegistry",
    "Entry",
    "EpisodeJournals",
    "EvalLane",
    "Feed",
    "FeedCursor",
    "Fleet",
    "GroupQueue",
    "Guarded",
    "Heartbeat",
    "Heartbeats",
    "JournalHash",
    "Keyspace",
    "LimitView",
    "Member",
    "NameLease",
    "NamespaceLimits",
    "PromptQueue",
    "RegistryEntry",
    "RolloutFlagsHash",
    "Server",
    "Sources",
    "StreamView",
    "TakeStats",
    "TrainerMonitor",
    "Translated",
    "admission_refusals",
    "check_engine_url",
    "flat_entries",
    "fold",
    "format_rate",
    "is_nogroup",
    "live_producers",
    "nogroup_error",
    "parse_limit",
    "parse_limits",
    "parse_limits_and_rates",
    "parse_rate",
    "raise_if_refused",
    "state_mismatch",
]
