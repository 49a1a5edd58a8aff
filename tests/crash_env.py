"""Environments whose process dies, or hangs, the way a crash in C code, the OOM killer or a
deadlock in an environment would, for the tests of actor and server restarts.

Used as `--env tests.crash_env:CrashingCartPole-v0`, `HangingCartPole-v0` or
`LockHoldingCartPole-v0` (importing this module registers the ids). All are CartPole-v1,
except that while the file named by $BEAST_CRASH_MARKER exists, a step kills its own process
with SIGKILL (no exception, no clean-up, no traceback), or sleeps for an hour, or (MonoBeast's
actors only) takes the write lock of the queue of filled rollouts (with --deterministic: the
schedule's lock) and then kills its process, as an actor killed in the middle of handing a
rollout on would. With $BEAST_CRASH_ONCE set, only the first step to find the marker does so:
it takes the marker away.
"""

import os
import signal
import sys
import time

import gymnasium as gym


def _marked():
    marker = os.environ.get("BEAST_CRASH_MARKER")
    if not marker or not os.path.exists(marker):
        return False
    if not os.environ.get("BEAST_CRASH_ONCE"):
        return True
    try:
        os.rename(marker, marker + ".taken")  # atomic: one step of one process wins
    except OSError:
        return False
    return True


class CrashingCartPole(gym.Wrapper):
    def __init__(self, render_mode=None):
        super().__init__(gym.make("CartPole-v1", render_mode=render_mode))

    def step(self, action):
        if _marked():
            self.fail()
        return self.env.step(action)

    def fail(self):
        os.kill(os.getpid(), signal.SIGKILL)


class HangingCartPole(CrashingCartPole):
    def fail(self):
        time.sleep(3600)


class LockHoldingCartPole(CrashingCartPole):
    def fail(self):
        frame = sys._getframe()  # up to the actor's loop, which steps us
        while not {"full_queue", "lockstep"} & set(frame.f_locals):
            frame = frame.f_back
        if "full_queue" in frame.f_locals:  # monobeast.actor
            frame.f_locals["full_queue"]._wlock.acquire()
        else:  # lockstep.act_in_lockstep (--deterministic)
            frame.f_locals["lockstep"].lock.acquire()
        super().fail()


# CartPole-v1's own TimeLimit is inside.
for _id, _entry in (("CrashingCartPole-v0", CrashingCartPole),
                    ("HangingCartPole-v0", HangingCartPole),
                    ("LockHoldingCartPole-v0", LockHoldingCartPole)):
    if _id not in gym.registry:
        gym.register(_id, entry_point=_entry)
