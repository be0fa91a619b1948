"""What operators do to a namespace: snapshot and health, dead letters, namespaces,
pause/resume and releasing a gone trainer. The CLI is a thin layer over these functions; they
are plain async functions over a redis client so scripts and dashboards can call them too.

Modules, one concern each:

* ``snapshot``: the ``snapshot()`` behind ``rollstream inspect`` and ``ns show`` (read-only, plain data)
* ``health``: the health rules: one rule set over a snapshot, no I/O (``assess``, ``DEFAULT_STUCK_AFTER``)
* ``archiver``: ``Archiver`` behind ``rollstream archive`` (long-running, like the feeder): reads the
  archive stream after its cursor, writes each contiguous run of one partition as one zstd Parquet file
  (temporary name, fsync, rename), then confirms (Lua ARCHIVED); the cursor is the highest last id in the
  files, so a killed archiver writes nothing twice; warns when ``archive_dropped`` grows
* ``archive_view``: ``rollstream archive view``: one static page (``archive_view.html`` beside it, the
  records embedded as JSON, text set with ``textContent`` only) to filter an archive's groups and open one
  (samples, turns by loss mask, rewards, versions, history)
* ``deadletter``: dead-letter entries: decode, list, requeue as a fresh attempt, drop
* ``namespaces``: list namespaces (SCAN), the keys of one, delete exactly them
* ``actions``: ``pause``, ``resume [version]``, ``release_consumer`` (a gone trainer's pending groups back
  to the stream)
"""

from rollstream.common.admission import DEFAULT_STALL_AFTER

from .actions import pause, release_consumer, resume
from .deadletter import DeadEntry, dead_entries, dead_entry, drop_dead, requeue_dead
from .health import DEFAULT_STUCK_AFTER, LEASE_WARNING_FRACTION, assess
from .namespaces import delete_namespace, delete_payload_objects, existing_keys, list_namespaces
from .snapshot import SCHEMA_VERSION, snapshot

__all__ = [
    "DEFAULT_STALL_AFTER",
    "DEFAULT_STUCK_AFTER",
    "LEASE_WARNING_FRACTION",
    "SCHEMA_VERSION",
    "DeadEntry",
    "assess",
    "dead_entries",
    "dead_entry",
    "delete_namespace",
    "delete_payload_objects",
    "drop_dead",
    "existing_keys",
    "list_namespaces",
    "pause",
    "release_consumer",
    "requeue_dead",
    "resume",
    "snapshot",
]
