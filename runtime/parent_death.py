"""``python -m rollstream.runtime.parent_death PARENT_PID -- COMMAND...``: run COMMAND so that it dies with
its parent.

Sets the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, kept across ``execve``),
checks the parent is still the one that started us (it may have died before the prctl), then
execs COMMAND in this process (same pid). Done here rather than in a ``preexec_fn``, which is not
safe in a process with threads (a trainer always has some). Elsewhere than Linux the command is
exec'd without the guard (the supervisor's own stop still applies).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """True when the kernel will send ``sig`` to this process when its parent thread exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write("usage: python -m rollstream.runtime.parent_death PARENT_PID -- COMMAND...\n")
        return 2
    parent, command = int(argv[0]), argv[2:]
    set_parent_death_signal()
    if os.getppid() != parent:
        return 3  # the parent died before the guard was set: do not start an orphan
    os.execvp(command[0], command)
    return 127  # not reached: execvp raises on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
