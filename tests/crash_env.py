"""An environment whose process dies the way a crash in C code or the OOM killer ends it, for
the tests of actor and server restarts.

Used as `--env tests.crash_env:CrashingCartPole-v0` (importing this module registers the id).
It is CartPole-v1, except that while the file named by $BEAST_CRASH_MARKER exists, its step
kills its own process with SIGKILL: no exception, no clean-up, no traceback.
"""

import os
import signal

import gymnasium as gym


class CrashingCartPole(gym.Wrapper):
    def __init__(self, render_mode=None):
        super().__init__(gym.make("CartPole-v1", render_mode=render_mode))

    def step(self, action):
        marker = os.environ.get("BEAST_CRASH_MARKER")
        if marker and os.path.exists(marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.env.step(action)


if "CrashingCartPole-v0" not in gym.registry:  # CartPole-v1's own TimeLimit is inside
    gym.register("CrashingCartPole-v0", entry_point=CrashingCartPole)
