"""CartPoles that misbehave, to test that runs survive them: one whose step raises now and
then, one whose reward turns infinite.

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


class InfiniteRewardCartPole(gym.Wrapper):
    """A CartPole whose reward becomes infinite after `good_steps` steps of its lifetime."""

    def __init__(self, good_steps=3000):
        super().__init__(gym.make("CartPole-v1"))
        self.good_steps = good_steps
        self.steps = 0

    def step(self, action):
        self.steps += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.steps > self.good_steps:
            reward = float("inf")
        return obs, reward, terminated, truncated, info


if "InfiniteRewardCartPole-v0" not in gym.registry:
    gym.register(id="InfiniteRewardCartPole-v0", entry_point=InfiniteRewardCartPole)

