"""Whether a process the test did not start itself (a grandchild) is still running."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent has not reaped it).

    The state is the field after the command name, which may itself hold spaces and ``)``.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
