"""A task that needs both entries of its Dict observation, for tests/test_dict_obs.py.

Used as `--env tests.dict_obs_env:DictCue-v0` (importing this module registers the ids), so that
env servers started in their own processes build it too.

Every step deals K = NUM_ACTIONS cards, one per action in a random order:
  cues    uint8 [1, K, K], an image: row r is the one-hot (255 = lit) of the action on card r;
  target  float32 [K], the one-hot of the card to play.
Playing the action on the target card earns 1, anything else 0, and ends the episode (one step
each: the return is that step's reward, which no later reward blurs; with 10-step episodes the
same runs learned several times slower). From either entry alone the right action is uniform
over the K actions (the order of the cards is a random permutation, the target card uniform and
independent of it), so a policy that ignores one entry earns 1 / K = 0.25 per episode in
expectation whatever it learns; one that reads both earns 1.

`DictCueText-v0` adds a Text entry, `note`, which no model can encode: the run must refuse it.
"""

import gymnasium as gym
import numpy as np
from gymnasium import spaces

NUM_ACTIONS = 4
EPISODE_LENGTH = 1


class DictCue(gym.Env):
    def __init__(self, with_text=False, render_mode=None):
        entries = dict(
            cues=spaces.Box(0, 255, (1, NUM_ACTIONS, NUM_ACTIONS), dtype=np.uint8),
            target=spaces.Box(0.0, 1.0, (NUM_ACTIONS,), dtype=np.float32),
        )
        if with_text:
            entries["note"] = spaces.Text(max_length=8)
        self.observation_space = spaces.Dict(entries)
        self.action_space = spaces.Discrete(NUM_ACTIONS)
        self.with_text = with_text
        self.render_mode = render_mode  # nothing to render; accepted because make passes it
        self.steps = 0
        self.answer = 0

    def _deal(self):
        order = self.np_random.permutation(NUM_ACTIONS)  # order[r]: the action on card r
        card = int(self.np_random.integers(NUM_ACTIONS))
        self.answer = int(order[card])
        cues = np.zeros((1, NUM_ACTIONS, NUM_ACTIONS), dtype=np.uint8)
        cues[0, np.arange(NUM_ACTIONS), order] = 255
        target = np.zeros(NUM_ACTIONS, dtype=np.float32)
        target[card] = 1.0
        observation = dict(cues=cues, target=target)
        if self.with_text:
            observation["note"] = "card"
        return observation

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self._deal(), {}

    def step(self, action):
        reward = 1.0 if int(action) == self.answer else 0.0
        self.steps += 1
        return self._deal(), reward, self.steps >= EPISODE_LENGTH, False, {}


for _id, _kwargs in (("DictCue-v0", {}), ("DictCueText-v0", dict(with_text=True))):
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=DictCue, kwargs=_kwargs)
