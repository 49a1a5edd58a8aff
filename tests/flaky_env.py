"""CartPoles that misbehave, to test that runs survive them, or end with one message: one
whose step raises now and then, ones whose reward turns infinite, NaN or huge.

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
    """A CartPole whose reward becomes `bad_reward` (inf) after `good_steps` steps of its
    lifetime. Registered as InfiniteRewardCartPole-v0 and NaNRewardCartPole-v0 (nan), both
    bad after 300 steps, and HugeRewardCartPole-v0 (1e30: finite, and so taken, but its
    squared error in the loss is not), after 3000."""

    def __init__(self, good_steps=3000, bad_reward=float("inf")):
        super().__init__(gym.make("CartPole-v1"))
        self.good_steps = good_steps
        self.bad_reward = bad_reward
        self.steps = 0

    def step(self, action):
        self.steps += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.steps > self.good_steps:
            reward = self.bad_reward
        return obs, reward, terminated, truncated, info


for _id, _reward, _good_steps in (("InfiniteRewardCartPole-v0", float("inf"), 300),
                                  ("NaNRewardCartPole-v0", float("nan"), 300),
                                  ("HugeRewardCartPole-v0", 1e30, 3000)):
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=InfiniteRewardCartPole,
                     kwargs=dict(bad_reward=_reward, good_steps=_good_steps))
