"""MinAtar's games (the minatar package) as create_env makes them: channels-first float32 frames.

    action (int) -> MinAtar -> bool [10, 10, C] -> ChannelsFirst -> float32 [C, 10, 10]

beast/envs.py `create_env` calls `make_minatar` for the ids that start with MinAtar/.

Only numpy, gymnasium and minatar (on first use) are imported.
"""

import gymnasium
import numpy as np
from gymnasium import spaces


def make_minatar(env_id, **make_kwargs):
    """ChannelsFirst over gymnasium.make(env_id) of a MinAtar id; make_kwargs (render_mode) go to
    gymnasium.make. Raises ValueError without minatar, or for an id it does not register."""
    try:
        import minatar.gym
    except ImportError as error:
        raise ValueError(f"Environment {env_id!r} needs the MinAtar package: "
                         "pip install minatar") from error
    if env_id not in gymnasium.registry:
        minatar.gym.register_envs()
    if env_id not in gymnasium.registry:
        ids = [name for name in gymnasium.registry if name.startswith("MinAtar/")]
        raise ValueError(f"Unknown MinAtar id {env_id!r}; MinAtar ids are: {', '.join(ids)}")
    return ChannelsFirst(gymnasium.make(env_id, disable_env_checker=True, **make_kwargs))


class ChannelsFirst(gymnasium.ObservationWrapper):
    """[H, W, C] observations (MinAtar's bool planes) -> float32 [C, H, W]."""

    def __init__(self, env):
        super().__init__(env)
        height, width, channels = env.observation_space.shape
        self.observation_space = spaces.Box(0.0, 1.0, (channels, height, width), dtype=np.float32)

    def observation(self, observation):
        return np.array(observation.transpose(2, 0, 1), dtype=np.float32, order="C")
