"""What operators do to a namespace: snapshot and health, dead letters, namespaces,
pause/resume and releasing a gone trainer. The CLI is a thin layer over these functions; they
are plain async functions over a redis client so scripts and dashboards can call them too."""

from rollstream.common.admission import DEFAULT_STALL_AFTER

from .actions import pause, release_consumer, resume
from .deadletter import DeadEntry, dead_entries, dead_entry, drop_dead, requeue_dead
from .health import DEFAULT_STUCK_AFTER, LEASE_WARNING_FRACTION, assess
from .namespaces import delete_namespace, existing_keys, list_namespaces
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
    "drop_dead",
    "existing_keys",
    "list_namespaces",
    "pause",
    "release_consumer",
    "requeue_dead",
    "resume",
    "snapshot",
]
