"""The Redis protocol of one namespace: the commands on its keys and the shapes of its payloads.

The producer, the consumer and the operator tools talk to Redis through these typed operations;
the atomic hand-overs themselves are the Lua scripts of :mod:`..lua`, which this module calls.

* :class:`PromptQueue`: a producer's side of the prompt streams (retry first): admit, renew leases, take over
  idle prompts with XAUTOCLAIM (keeping its cursor), adopt its own pending prompts, publish a
  group, return or dead-letter a prompt.
* :class:`GroupQueue`: the trainer's side of the group stream: read, own pending, orphans,
  recycle, dead-letter, drop, commit.
* :class:`Control`: weight version and pause/resume in the ``state`` hash, announced on the
  ``control`` channel so waiting producers wake at once.
* :class:`Heartbeat`: the producers' heartbeat, written and parsed here only, with the one
  liveness rule (:meth:`Heartbeat.alive`).
* :class:`Feed` (the feeder's cursor and prompt window), :class:`DeadLetters`, namespace keys;
  :class:`TrainerMonitor` (what ``take()`` reports and the diagnosis of a wait, one round trip each).
* NOGROUP (the namespace was deleted, a consumer group destroyed; also raised inside a Lua
  script) becomes :class:`~.errors.NamespaceGone` naming the namespace, or
  :class:`~.errors.RedisDataLost` when Redis restarted without persistence since the first call;
  NOPERM becomes :class:`~.errors.RedisPermissionDenied` and OOM :class:`~.errors.RedisOutOfMemory`
  (:mod:`.redis_errors`). Every public coroutine method of a namespace client (:class:`_Guarded`)
  is wrapped in that guard when its class is made, so no method can forget it; the module's
  functions are decorated with :func:`~.redis_errors.translate_errors`.
"""

from ..heartbeat import Heartbeat, admission_refusals, live_producers
from .control import TAKEN_MESSAGE, Control
from .feed import Feed, FeedCursor, state_mismatch
from .groups import GroupQueue, NameLease, held_consumer_names
from .guard import (
    Entry,
    Guarded,
    ack_or_nogroup,
    flat_entries,
    is_nogroup,
    namespace_gone,
    nogroup_error,
    raise_if_refused,
    server_memory,
    server_run_id,
)
from .heartbeats import read_heartbeats, write_heartbeat
from .keyspace import delete_namespace, existing_keys, scan_namespace_keys
from .prompts import Admission, Admitted, PromptQueue
from .stores import DeadLetters, JournalHash, RolloutFlagsHash
from .trainer import Diagnosis, TakeStats, TrainerMonitor, mark_take, read_admission_terms
from .views import StreamView

__all__ = [
    "TAKEN_MESSAGE",
    "Admission",
    "Admitted",
    "Control",
    "DeadLetters",
    "Diagnosis",
    "Entry",
    "Feed",
    "FeedCursor",
    "GroupQueue",
    "Guarded",
    "Heartbeat",
    "JournalHash",
    "NameLease",
    "PromptQueue",
    "RolloutFlagsHash",
    "StreamView",
    "TakeStats",
    "TrainerMonitor",
    "ack_or_nogroup",
    "admission_refusals",
    "delete_namespace",
    "existing_keys",
    "flat_entries",
    "held_consumer_names",
    "is_nogroup",
    "live_producers",
    "mark_take",
    "namespace_gone",
    "nogroup_error",
    "raise_if_refused",
    "read_admission_terms",
    "read_heartbeats",
    "scan_namespace_keys",
    "server_memory",
    "server_run_id",
    "state_mismatch",
    "write_heartbeat",
]
