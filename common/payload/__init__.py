"""The payload plane: per-token arrays too large for a stream entry live in a store (a shared
directory, Mooncake), the entry keeps a reference per object. :mod:`.store` is the interface
and :func:`~.store.open_store`; :mod:`.fs` and :mod:`.mooncake` are the backends."""

from .refs import Buffer, GroupPayload, ObjectRef, Offloaded, check_key, checksum
from .store import PayloadStore, open_store

__all__ = [
    "Buffer", "GroupPayload", "ObjectRef", "Offloaded", "PayloadStore", "check_key", "checksum", "open_store",
]
