"""When a process that died is started again: MonoBeast's actors, PolyBeast's env servers.

A process that dies while it serves (a crash in an environment's C code, the OOM killer, a
hang that a watchdog ended) is started again. One that dies within QUICK_EXIT_S of its start
never came up (an import error, an address it cannot take, an environment that crashes at
once): on its first start that ends the run, and so do MAX_QUICK_RESTARTS such starts in a
row, rather than a loop of restarts. The other way round, a process whose parent died
(killed, with no chance to stop it) ends itself: when_orphaned.
"""

import os
import signal
import sys
import threading
import time

QUICK_EXIT_S = 5.0
MAX_QUICK_RESTARTS = 3


class RestartPolicy:
    """The restarts of one process (or group of processes), counted."""

    def __init__(self):
        self.restarts = 0  # starts after the first
        self.quick = 0  # restarts in a row that ended within QUICK_EXIT_S

    def why_not(self, ran_s):
        """Called when the process died after ran_s seconds: None to start it again (which
        counts as a restart), else the reason not to, in words."""
        quick = ran_s < QUICK_EXIT_S
        self.quick = self.quick + 1 if quick and self.restarts else 0
        if quick and not self.restarts:
            return f"the first start ended after {ran_s:.1f} s, too soon to have come up"
        if self.quick >= MAX_QUICK_RESTARTS:
            return f"the last {self.quick} starts each ended within {QUICK_EXIT_S:g} s"
        self.restarts += 1
        return None


def how_it_ended(exitcode):
    """A process's end in words, from its exit code (negative: the signal that killed it)."""
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        name = f" ({signal.Signals(-exitcode).name})"
    except ValueError:  # a real-time signal has no name
        name = ""
    return f"was killed by signal {-exitcode}{name}"


def when_orphaned(parent_pid, action, poll_s=1.0, name="parent-watch"):
    """Calls action() in a daemon thread once parent_pid is no longer this process's parent.
    A parent killed with SIGKILL cannot stop its children; without this they would run on,
    orphaned, holding their cores (and, blocked on a pipe that their siblings keep open,
    waiting for ever). A look every poll_s seconds costs the process nothing."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        action()

    threading.Thread(target=watch, name=name, daemon=True).start()


class ActorDied(RuntimeError):
    """An actor process ended before it was told to (or hung, and was killed)."""

    def __init__(self, index, exitcode, hung_s=None):
        self.exitcode = exitcode
        if hung_s is not None:
            how = (f"had spent {hung_s:.0f} s on its start or on one step of its environments "
                   "and model (--actor_timeout_s); its stack is above, and it was killed")
        elif exitcode == 0:
            how = "exited before it was told to stop"
        elif exitcode < 0:
            how = how_it_ended(exitcode)
        else:
            how = f"died with exit code {exitcode}; its traceback is above"
        super().__init__(f"Actor process {index} {how}.")


def check_actors(actors):
    """Raises ActorDied if an actor process has ended: an actor runs until it is told to stop,
    so any end before that (a clean exit included) leaves the learner waiting on it."""
    for i, process in enumerate(actors):
        if process.exitcode is not None:
            raise ActorDied(i, process.exitcode)


def join_actors(actors, timeout_s=10.0):
    """Waits for the actor processes to exit (they stop on the None in their queue, or when
    the schedule closes); one that does not within timeout_s is killed (they ignore SIGTERM,
    and one may be stuck on a lock that a dead actor held)."""
    deadline = time.monotonic() + timeout_s
    for process in actors:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=5)



def start_again_or_stop(policy, died, started, not_again, again):
    """After a process died (`died`, its ActorDied or like error): prints the warning that it is
    started again, or raises the UserError that ends the run. started: its time.monotonic() at
    the start; not_again, again: the two sentences' openings ("The actors are not started
    again", "Starting the actors again")."""
    from beast.training import UserError  # here: env servers import this module, without torch

    why_not = policy.why_not(time.monotonic() - started)
    if why_not is not None:
        raise UserError(f"{died} {not_again}: {why_not}.") from None
    print(f"\nwarning: {died} {again} (restart {policy.restarts}); the rollouts in flight are "
          "dropped, the weights kept.", file=sys.stderr)
