"""What a run asks of the operating system: stop signals, thread names, intra-op threads
and how the learner's process keeps freed memory. Linux-specific parts do nothing
elsewhere."""

import ctypes
import signal
import sys
import threading
import time

import torch


# A second stop signal within this many seconds of the first is the same request delivered
# twice, not a user insisting: GNU `timeout` signals its child and then the child's whole
# process group, so `timeout 3600 python -m monobeast ...` delivers SIGTERM twice at once.
REPEATED_SIGNAL_S = 2.0


def install_signal_handlers():
    """SIGTERM and SIGINT set an event; the main loop stops and checkpoints. Another one at
    least REPEATED_SIGNAL_S later (a second Ctrl-C) stops at once, without the checkpoint."""
    stop = threading.Event()
    first = []  # monotonic time of the first signal

    def handler(signum, frame):
        now = time.monotonic()
        if not first:
            first.append(now)
            stop.set()
        elif now - first[0] >= REPEATED_SIGNAL_S:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    return stop


def leave_stop_signals_to_the_learner():
    """In a child of the learner (MonoBeast's actors, PolyBeast's acting process, forked or
    spawned):
    Ctrl-C, and the SIGTERM that timeout(1) or Slurm send, go to the whole process group, and
    the learner checkpoints and then stops its children. Ignored rather than left to the
    handler above, which the fork copied: that one swallowed Process.terminate() and turned a
    second signal into a KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def set_intra_op_threads(n):
    """Gives the calling thread n intra-op threads for its own parallel ops.

    With OpenMP the count is per thread, and a thread takes its count lazily, at its
    first parallel op or get_num_threads(), from the value that any thread set LAST: a
    set_num_threads() in a new thread that has not yet asked is overwritten by that lazy
    start, so its parallel ops run on the process-wide count after all. Asking first
    makes the thread's own setting stick."""
    torch.get_num_threads()
    torch.set_num_threads(n)


# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def reuse_freed_memory():
    """Makes glibc keep the memory a process frees for its next allocations, instead of
    handing it back to the kernel. Call it before the threads that allocate start.

    A learner step allocates and frees the activations and gradients of T x B frames, a few
    hundred MB on Atari. glibc serves blocks that large with mmap and returns them with
    munmap, so every step would fault all of it in again, page by page, in the kernel. Here:
    one arena for all threads (a thread's own arena cannot grow past 64 MB, so its large
    blocks are always mmapped), blocks up to 1 GiB from that heap, and no trimming of its
    top: the process stays at its peak size and reuses it. The price is one arena lock for
    every thread, which is why PolyBeast's inference runs in a process of its own, and why
    only Atari learners call this (training.start_process): elsewhere the blocks are small. Linux
    with glibc only; elsewhere, or if mallopt refuses, nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS has no mallopt)
        return
    mallopt(_M_ARENA_MAX, 1)
    # glibc refuses a threshold above its limit (32 MiB in some versions): then take that.
    if not mallopt(_M_MMAP_THRESHOLD, 1 << 30):
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


_PR_SET_NAME = 15  # prctl(2)


def name_os_thread(name):
    """Gives the calling thread `name` (its first 15 bytes) as its OS name, which top -H
    and py-spy show: Python's thread names stay inside Python, so without this
    every thread of a run is "python" and a profile cannot tell the learner from inference.
    Linux only; elsewhere, or if prctl is missing, it does nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
