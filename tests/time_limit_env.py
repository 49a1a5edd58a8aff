"""An environment that only a time limit ends, for tests of truncation.

Reward 1 on every step, never terminated; Gymnasium's TimeLimit cuts each episode after
LIMIT steps. The observation is the time, t / LIMIT, so the value of each step can be read
off a trained model. Used as `--env tests.time_limit_env:ConstantReward-v0`.
"""

import gymnasium as gym
import numpy as np

LIMIT = 20


class ConstantReward(gym.Env):
    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(1, self.t / LIMIT, np.float32), 1.0, False, False, {}


if "ConstantReward-v0" not in gym.registry:
    gym.register(id="ConstantReward-v0", entry_point=ConstantReward, max_episode_steps=LIMIT)
