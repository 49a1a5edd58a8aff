"""Helpers for tests that check which processes are left: a process that has ended but not
been reaped (a zombie) counts as gone."""

import time


def alive(pid):
    """True for a running process (a zombie, ended but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout_s):
    """Waits until none of pids is alive or timeout_s has passed; the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
