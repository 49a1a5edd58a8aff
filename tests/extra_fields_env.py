"""A CartPole that adds two rollout fields of its own, for tests/test_rollout.py.

Used as `--env tests.extra_fields_env:ExtraFieldsCartPole-v0` (importing this module registers
the id), so that env servers started in their own processes build it too.
"""

import gymnasium as gym
import numpy as np

from beast import rollout


class ExtraFields(gym.Wrapper):
    """Declares `steps` (int32: steps of the episode so far, equal to the rollout's
    episode_step by construction) and `position` (float32 [2]: the first two numbers of the
    observation that step returned), and reports them in the info of every step."""

    rollout_fields = (
        rollout.Field("steps", np.int32, (), rollout.ENV, "steps of the episode so far"),
        rollout.Field("position", np.float32, (2,), rollout.ENV, "obs[:2] of the step"),
    )

    def __init__(self, env):
        super().__init__(env)
        self.steps = 0

    def reset(self, **kwargs):
        self.steps = 0
        return self.env.reset(**kwargs)  # no fields here: the adapter writes zeros

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        info = dict(info, steps=self.steps, position=obs[:2])
        return obs, reward, terminated, truncated, info


if "ExtraFieldsCartPole-v0" not in gym.registry:
    gym.register(id="ExtraFieldsCartPole-v0",
                 entry_point=lambda **kwargs: ExtraFields(gym.make("CartPole-v1", **kwargs)))
