"""Named points of the producer's publish path where a fault test stops the process itself, so a
real SIGKILL lands exactly there (``tests/test_payload_faults.py``): with the environment
variable ``ROLLSTREAM_FAULT_STOP`` set to a point's name, the producer sends itself SIGSTOP on
reaching it (once per process), and the test kills the stopped process. Unset (always, outside
the tests): nothing."""

from __future__ import annotations

import os
import signal

POINTS = ("after_put", "after_publish")
"""``after_put``: the group's payload objects are in the store, PUBLISH not sent;
``after_publish``: PUBLISH returned (the objects are claimed)."""
_ARMED = {os.environ.get("ROLLSTREAM_FAULT_STOP", "")} & set(POINTS)


def reached(point: str) -> None:
    """Stop this process here if a fault test armed ``point`` (once)."""
    if point in _ARMED:
        _ARMED.discard(point)
        os.kill(os.getpid(), signal.SIGSTOP)
