"""A CartPole whose step raises now and then, to test that actors survive it.

Used as `--env tests.flaky_env:FlakyCartPole-v0` (importing this module
registers the id).
"""

import gymnasium as gym


class FlakyCartPole(gym.Wrapper):
    """Raises RuntimeError on every `fail_every`-th step of its lifetime."""

    def __init__(self, fail_every=500):
        super().__init__(gym.make("CartPole-v1"))
        self.fail_every = fail_every
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps % self.fail_every == 0:
            raise RuntimeError("simulated environment failure")
        return self.env.step(action)


if "FlakyCartPole-v0" not in gym.registry:
    gym.register(id="FlakyCartPole-v0", entry_point=FlakyCartPole)
