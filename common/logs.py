"""Log lines that say who wrote them: ``producer p1 (ns demo): drain requested``.

A producer, a trainer's consumer and a feeder share a process (and a logger name) with others of
their kind in tests, the demo and the one-flag run; :class:`Prefixed` puts their name and
namespace in front of every message, written once where the object is built instead of by hand
at every call."""

from __future__ import annotations

import logging
from typing import Any


class Prefixed(logging.LoggerAdapter[logging.Logger]):
    """``logger`` with ``"{role} {name} (ns {namespace}): "`` in front of each message (the parts
    that are empty are left out). The arguments stay %-style and are formatted only when the line
    is emitted."""

    def __init__(self, logger: logging.Logger, role: str, name: str = "", namespace: str = "") -> None:
        super().__init__(logger, {})
        who = " ".join(part for part in (role, name) if part)
        self.prefix = f"{who} (ns {namespace}): " if namespace else f"{who}: "
        self._escaped = self.prefix.replace("%", "%%")  # a name with a % in it must not be read as a format

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            kwargs.setdefault("stacklevel", 2)  # the caller's line, as with a plain logger
            self.logger.log(level, f"{self._escaped if args else self.prefix}{msg}", *args, **kwargs)
