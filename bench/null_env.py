"""The null environment: constant frames and no work in step, so that what a benchmark measures
on it is the system's own overhead per step.

    --env bench.null_env:Null-v0       float32 [4]
    --env bench.null_env:NullAtari-v0  uint8 [4, 84, 84], Atari's frame shape

Two actions, reward 0, episodes of exactly 100 steps. The ids are registered when this module is
imported, which beast/envs.py `create_env` does for an id of the form `module:EnvId` (in every
process: MonoBeast's actors, PolyBeast's env servers). Registered without Gymnasium's
order-enforcing wrapper, so that `create_env` returns the bare NullEnv, whose step costs
next to nothing.
"""

import gymnasium
import numpy as np
from gymnasium import spaces

ENV_ID = "bench.null_env:Null-v0"
ATARI_ENV_ID = "bench.null_env:NullAtari-v0"


class NullEnv(gymnasium.Env):
    """Constant zero observations, 2 actions, reward 0, episodes of exactly `episode_length`
    steps. It renders nothing: render() raises, whatever render_mode it is given."""

    metadata = {"render_modes": []}

    def __init__(self, observation_shape=(4,), dtype=np.float32, episode_length=100,
                 render_mode=None):
        self.render_mode = render_mode
        high = 255 if np.dtype(dtype) == np.uint8 else np.inf
        self.observation_space = spaces.Box(0, high, tuple(observation_shape), dtype=dtype)
        self.action_space = spaces.Discrete(2)
        self.episode_length = episode_length
        self._step = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._step = 0
        return np.zeros(self.observation_space.shape, self.observation_space.dtype), {}

    def step(self, action):
        self._step += 1
        # A fresh array (np.zeros is a cheap calloc) so that callers may keep what they get.
        obs = np.zeros(self.observation_space.shape, self.observation_space.dtype)
        return obs, 0.0, self._step >= self.episode_length, False, {}


for _name, _kwargs in (("Null-v0", {}),
                       ("NullAtari-v0", dict(observation_shape=(4, 84, 84), dtype=np.uint8))):
    if _name not in gymnasium.registry:
        gymnasium.register(_name, entry_point=NullEnv, kwargs=_kwargs, order_enforce=False,
                           disable_env_checker=True)
