"""The EnvPool backend (--env_backend envpool, optional: pip install envpool): Atari games
stepped by EnvPool's C++ threads without the GIL, preprocessed as beast/atari_wrappers.py does.

    actions [N] -> EnvPoolVectorEnv.step -> envpool step (C++ threads: emulator, frame skip,
        max-pool, resize, stack) -> dict of arrays [N, ...] in RolloutAdapter's convention

`create_envpool` makes the pool; `EnvPoolVectorEnv` is the backend of beast/vector_envs.py
(MonoBeast's actors, PolyBeast's env streams); `EnvPoolSingle` is one EnvPool env as a plain
Gymnasium env, what beast/envs.py `create_env` returns for this backend. EnvPool resets a
finished environment on the *next* step, ignoring that step's action: EnvPoolVectorEnv takes
that step at once and EnvPoolSingle in its reset(), so that the caller sees our convention (a
step that ends an episode returns the next episode's first frame). EnvPool applies no Python
wrapper: beast/envs.py `check_backend` refuses this backend while envs.WRAPPERS is not empty.
"""

import re

import gymnasium
import numpy as np

from beast import atari_wrappers
from beast import rollout


def _import_envpool():
    try:
        import envpool
    except ImportError as error:
        raise ValueError("--env_backend envpool needs the EnvPool package: "
                         "pip install envpool") from error
    return envpool


def create_envpool(flags, num_envs, batch_size=None, seed=None, num_threads=1):
    """EnvPool's own batched Atari env (Gymnasium API, leading dim = batch), preprocessed as ours
    (bench/envpool_frames.py). Its reset presses FIRE for one emulator frame where ours presses
    it for one agent step, so its games run 3 frames behind ours with the same actions.

    Gray 84x84, 4-frame stack, frame skip 4, FIRE on reset, no reward clipping, 27000 steps per
    episode, and flags' episodic_life, noop_max, action set and sticky-action probability.
    Seeded with `seed` (default flags.seed) at creation; EnvPool cannot be reseeded by reset.
    num_threads: EnvPool's C++ threads; 1 by default, because each of our actors (or server
    streams) already gets a core of its own. Its info holds
    "terminated" (the real game ended) and "lives". EnvPool resets an env itself on the step after
    that env's episode ended, ignoring that step's action.
    """
    envpool = _import_envpool()
    kwargs = atari_wrappers.atari_spec_kwargs(flags.env)
    match = re.fullmatch(r"(?:ALE/)?([A-Za-z]+?)(?:NoFrameskip)?-v\d+", flags.env)
    if kwargs is None or match is None:
        raise ValueError("--env_backend envpool supports Atari ids only (ALE/Pong-v5, "
                         f"PongNoFrameskip-v4), got {flags.env!r}")
    return envpool.make(
        f"{match.group(1)}-v5", env_type="gymnasium", num_envs=num_envs,
        batch_size=batch_size or num_envs,
        num_threads=num_threads,
        seed=(flags.seed if seed is None else int(seed)) % 2**31,
        episodic_life=bool(flags.episodic_life),
        reward_clip=False, stack_num=4, gray_scale=True, img_height=84, img_width=84, frame_skip=4,
        # EnvPool draws 0..noop_max-1 no-op frames (ours: 1..noop_max, or none at 0); 1 asks
        # it for none, where 0 would draw from an empty range.
        noop_max=max(atari_wrappers.noop_max(flags), 1), use_fire_reset=True,
        full_action_space=atari_wrappers.full_action_space(flags, kwargs),
        repeat_action_probability=atari_wrappers.sticky_action_probability(flags, kwargs),
        max_episode_steps=atari_wrappers.MAX_FRAMES_PER_EPISODE // 4,
    )


class EnvPoolSingle(gymnasium.Env):
    """One EnvPool env (num_envs=1) as a plain Gymnasium env, so that RolloutAdapter can drive
    it."""

    def __init__(self, pool):
        self.pool = pool
        # beast/envs.py env_kind: the kind whose defaults a run takes.
        self.env_kind = atari_wrappers.sticky_kind(pool.config["repeat_action_probability"])
        self.observation_space = pool.observation_space
        self.action_space = pool.action_space
        self._action = np.zeros(1, dtype=np.int32)
        self._episode_ended = False

    def reset(self, *, seed=None, options=None):
        if self._episode_ended:
            # EnvPool resets on the step after an episode's end (continuing the game after a lost
            # life with episodic_life), and its reset() would always start a new game.
            obs, _, _, _, info = self.pool.step(self._action)
        else:
            obs, info = self.pool.reset()
        self._episode_ended = False
        return obs[0], {"lives": int(info["lives"][0]), "game_over": False}

    def step(self, action):
        self._action[0] = action
        obs, reward, terminated, truncated, info = self.pool.step(self._action)
        terminated, truncated = bool(terminated[0]), bool(truncated[0])
        game_over = bool(info["terminated"][0]) or truncated
        self._episode_ended = terminated or truncated
        info = {"lives": int(info["lives"][0]), "game_over": game_over}
        return obs[0], float(reward[0]), terminated, truncated, info

    def close(self):
        self.pool.close()


class EnvPoolVectorEnv:
    """One EnvPool (synchronous: every step() steps all N environments) in our convention.

    The returned arrays are reused by the next call: copy what you keep.
    """

    restarts = 0  # EnvPool's environments are never restarted from here

    def __init__(self, flags, num_envs, seed):
        self.num_envs = num_envs
        self.pool = create_envpool(flags, num_envs, seed=seed)
        self.env_ids = np.arange(num_envs, dtype=np.int32)
        space = self.pool.observation_space
        self.fields = rollout.core_env_fields(space.shape, space.dtype)
        self.outputs = {f.name: np.zeros((num_envs,) + f.shape, dtype=f.dtype) for f in self.fields}
        self._return = np.zeros(num_envs, dtype=np.float64)
        self._length = np.zeros(num_envs, dtype=np.int64)
        self._cut = np.zeros(num_envs, dtype=bool)  # the last step hit a time limit

    def initial(self):
        frame, info = self.pool.reset()
        out = self.outputs
        for key, array in out.items():
            if key != "frame":
                array[:] = 0
        out["frame"][info["env_id"]] = frame
        out["done"][:] = True
        self._return[:] = 0
        self._length[:] = 0
        self._cut = np.zeros(self.num_envs, dtype=bool)
        return out

    def step(self, actions):
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,):
            raise ValueError(f"expected {self.num_envs} actions, got an array of shape "
                             f"{actions.shape}")
        # Environments whose last step was cut by a time limit: EnvPool resets them now and
        # ignores their action, which is our convention for the step after a truncation.
        resetting, self._cut = self._cut, np.zeros(self.num_envs, dtype=bool)
        frame, reward, terminated, truncated, info = self.pool.step(
            actions.astype(np.int32), self.env_ids)
        ids = info["env_id"]  # rows come back in EnvPool's order
        out = self.outputs
        out["frame"][ids] = frame
        out["reward"][ids] = reward
        done = np.zeros(self.num_envs, dtype=bool)
        done[ids] = terminated
        self._cut[ids] = truncated & ~terminated
        game_over = np.zeros(self.num_envs, dtype=bool)
        # With episodic_life, terminated marks a lost life; info["terminated"] the game's end.
        game_over[ids] = info["terminated"].astype(bool) | truncated
        out["done"][:] = done | resetting
        out["truncated"][:] = self._cut
        out["game_over"][:] = game_over
        out["last_action"][:] = np.where(resetting, 0, actions)
        self._return[ids] += reward
        self._length[ids] += ~resetting[ids]
        out["episode_return"][:] = self._return
        out["episode_step"][:] = self._length
        self._return[game_over] = 0
        self._length[game_over] = 0
        if done.any():
            # EnvPool would reset these on the next step and ignore its action; do that step
            # now, so the caller gets the next episode's first frame with this step's done.
            ended = np.flatnonzero(done).astype(np.int32)
            frame, _, _, _, info = self.pool.step(np.zeros(len(ended), np.int32), ended)
            out["frame"][info["env_id"]] = frame
        return out

    def close(self):
        self.pool.close()
