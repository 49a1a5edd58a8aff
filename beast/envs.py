"""Environments: `create_env`, the Atari preprocessing, and the adapter to the rollout format.

This is the file to edit to train on another environment. MonoBeast's actors and PolyBeast's
environment servers both build their environments with `create_env(flags)` and step them through
`RolloutAdapter`, so a change here reaches both variants.

Data path of one actor step:

    action (int; float32 [A] for a Box action space, see BoxActions)
                 -> RolloutAdapter.step -> gym_env.step (our wrappers -> emulator)
                 -> dict(frame, reward, done, game_over, episode_return, episode_step, last_action)

Which ids `create_env` accepts:
  * Atari: `ALE/<Game>-v5` (sticky actions, repeat_action_probability 0.25) and the old
    `<Game>NoFrameskip-v4` / `<Game>-v4` (no sticky actions) and `-v0` (0.25) ids. Whatever the id,
    the emulator runs with frameskip 1 and `AtariPreprocessing` does the DeepMind-style
    preprocessing: no-op starts, frame skip 4 with max-pooling, 84x84 grayscale, 4-frame stack,
    FIRE on reset, optional end-of-life episodes.
  * MinAtar: `MinAtar/<Game>-v0|v1` (pip install minatar), channels-first float32 frames.
  * `Null-v0` (float32 [4]) and `NullAtari-v0` (uint8 [4, 84, 84]): constant frames, 2 actions,
    episodes of 100 steps, no work in step; they measure the system's own overhead.
  * Any other id in Gymnasium's registry (CartPole-v1, LunarLander-v3, ...), also
    `some.module:EnvId-v0`, which imports `some.module` first so that it can register its ids.
    Vector observations are cast to float32, Discrete observations become one-hot float32 vectors.
    A Dict observation (array entries only: see observation_layout) becomes one rollout field per
    entry, frame/<key>, each entry cast as above.
  * Environments written for the old gym API (reset() -> obs; step() -> (obs, reward, done, info))
    are detected and wrapped in `LegacyGymAPI` (see `create_env`).

Only numpy, gymnasium, ale_py and the optional environment packages (minatar, envpool) are imported.
"""

import difflib
import importlib
import re
import traceback

import ale_py
import gymnasium
import numpy as np
from gymnasium import spaces

from beast import rollout

gymnasium.register_envs(ale_py)

# Wrappers put around every environment that create_env makes (the first one innermost), for
# training, evaluation and env servers alike. Each is called as wrapper(env) and returns the
# wrapped env: a gymnasium.Wrapper subclass, or a function. To add one, write it and list it
# here, e.g. WRAPPERS = (gymnasium.wrappers.TransformReward,) with its arguments bound by
# functools.partial. A wrapper may add rollout fields of its own (beast/rollout.py,
# `rollout_fields`). The envpool backend steps its games in C++ and cannot apply them: it
# refuses to start while this list is not empty.
WRAPPERS = ()

# ALE's cap on an episode: 108000 frames (30 minutes of play), i.e. 27000 agent steps at frame
# skip 4.
MAX_FRAMES_PER_EPISODE = 108_000

MINATAR_IDS = tuple(
    f"MinAtar/{game}-{version}"
    for game in ("Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders")
    for version in ("v0", "v1")
)


# ---------------------------------------------------------------------------------------------
# Atari.


class AreaResize:
    """Shrinks a 2-D image by averaging over areas, the way OpenCV's INTER_AREA shrinks.

    Output pixel (i, j) is the mean of the input over the rectangle it covers, input pixels that
    are only partly covered weighted by the covered fraction. The resize is separable, and every
    output row (column) depends on at most ceil(scale) + 1 input rows (columns), so it is computed
    as a few gathers and multiply-adds ("taps") instead of a dense matrix product: that is faster
    for 210x160 -> 84x84 and never starts BLAS threads inside actor processes.
    """

    def __init__(self, in_shape, out_shape):
        self.row_index, self.row_weight = self._taps(in_shape[0], out_shape[0])
        self.col_index, self.col_weight = self._taps(in_shape[1], out_shape[1])
        self.row_weight = self.row_weight[:, :, None]  # broadcast over columns

    @staticmethod
    def _taps(n_in, n_out):
        """Returns index and weight, both [taps, n_out]:
        out[o] = sum_k weight[k, o] * in[index[k, o]]."""
        scale = n_in / n_out
        edges = np.arange(n_out + 1) * scale
        pixel = np.arange(n_in)[None, :]
        # Overlap of output cell [edges[o], edges[o+1]) with input pixel [p, p+1), divided by the
        # cell size.
        overlap = np.minimum(edges[1:, None], pixel + 1) - np.maximum(edges[:-1, None], pixel)
        weight = np.clip(overlap, 0.0, None) / scale
        num_taps = int((weight > 0).sum(axis=1).max())
        index = np.zeros((num_taps, n_out), dtype=np.intp)
        tap_weight = np.zeros((num_taps, n_out), dtype=np.float32)
        for o in range(n_out):
            (covered,) = np.nonzero(weight[o])
            index[: len(covered), o] = covered
            tap_weight[: len(covered), o] = weight[o, covered]
        return index, tap_weight

    def __call__(self, image):
        """image: uint8 or float [H_in, W_in]. Returns float32 [H_out, W_out] (not rounded)."""
        rows = image[self.row_index]  # [taps, H_out, W_in]
        out = self.row_weight[0] * rows[0]
        for k in range(1, len(rows)):
            out += self.row_weight[k] * rows[k]
        cols = out[:, self.col_index]  # [H_out, taps, W_out]
        result = self.col_weight[0] * cols[:, 0]
        for k in range(1, cols.shape[1]):
            result += self.col_weight[k] * cols[:, k]
        return result


class AtariPreprocessing(gymnasium.Wrapper):
    """DeepMind-style Atari preprocessing over an `ale_py.AtariEnv` made with frameskip=1.

    Our own implementation; it needs no OpenCV. Per agent step: repeat the action for `frame_skip`
    frames, summing the rewards; max-pool the last two grayscale screens (Atari sprites flicker
    between frames); shrink to `screen_size`^2 by area averaging; push onto a stack of the
    `frame_stack` newest frames.

    Observations are uint8 [frame_stack, screen_size, screen_size], oldest frame first, newest last.
    Each observation is a fresh array that is never written again, so callers may keep it.

    reset():
      * starts a new game (the real reset), then takes 1..noop_max random no-op frames (no-op
        starts), then presses FIRE for one agent step if the game has a FIRE action (many games do
        not start or relaunch the ball without it); the stack is filled with the first frame.
      * with episodic_life, after a step that lost a life but did not end the game, reset() only
        presses FIRE (if the game has it) and keeps the game running: the training episode ends
        at each life loss while the emulator is reset only at game over.

    info of every step holds "lives" and "game_over": True only when the real game ended
    (terminated or truncated by ALE's frame limit), which `RolloutAdapter` uses to report the real
    game's return and length even with end-of-life episodes.

    For speed, step() drives the ALE interface of the wrapped env directly instead of calling
    AtariEnv.step once per frame; sticky actions (repeat_action_probability) live inside ALE and
    apply all the same.
    """

    def __init__(self, env, noop_max=30, frame_skip=4, frame_stack=4, screen_size=84,
                 episodic_life=False, fire_reset=True):
        super().__init__(env)
        atari = env.unwrapped
        if not isinstance(atari, ale_py.AtariEnv):
            raise TypeError(f"AtariPreprocessing needs an ale_py.AtariEnv, "
                            f"got {type(atari).__name__}")
        if env is not atari:
            # step() drives ALE itself, so a wrapper in between would silently never run.
            raise TypeError(
                f"AtariPreprocessing drives the emulator directly, so {type(env).__name__} between "
                "it and the AtariEnv would never run; wrap the preprocessed env instead "
                "(beast/envs.py WRAPPERS)")
        if getattr(atari, "_frameskip", 1) != 1:
            raise ValueError("AtariPreprocessing does the frame skipping: make the AtariEnv with "
                             "frameskip=1")
        if frame_skip < 2:
            raise ValueError("frame_skip must be >= 2: the last two frames are max-pooled")
        self.ale = atari.ale
        self.noop_max = noop_max
        self.frame_skip = frame_skip
        self.frame_stack = frame_stack
        self.episodic_life = episodic_life

        meanings = atari.get_action_meanings()
        # Index of the agent's action -> ALE action enum, resolved once instead of every step.
        self._ale_actions = [ale_py.Action[name] for name in meanings]
        self._noop = ale_py.Action.NOOP
        self._fire = ale_py.Action.FIRE if (fire_reset and "FIRE" in meanings) else None

        height, width = self.ale.getScreenDims()
        # The last two frames of a step.
        self._screens = np.zeros((2, height, width), dtype=np.uint8)
        self._max_screen = np.zeros((height, width), dtype=np.uint8)
        self._resize = AreaResize((height, width), (screen_size, screen_size))
        self._stack = np.zeros((frame_stack, screen_size, screen_size), dtype=np.uint8)
        self._lives = 0
        self._life_lost = False  # the last step ended a training episode but not the game

        self.observation_space = spaces.Box(0, 255, self._stack.shape, dtype=np.uint8)
        self.action_space = spaces.Discrete(len(self._ale_actions))
        # One rendered screen per agent step: the emulator's 60 frames a second / frame_skip
        # plays a video (beast/video.py) at the game's real speed.
        self.metadata = {**env.metadata, "render_fps": 60 / frame_skip}

    def _repeat(self, ale_action):
        """Plays ale_action for frame_skip frames, grabbing the last two screens. Returns the
        reward sum."""
        ale = self.ale
        first_grab = self.frame_skip - 2
        reward = 0.0
        for i in range(self.frame_skip):
            reward += ale.act(ale_action)
            if i >= first_grab:
                ale.getScreenGrayscale(self._screens[i - first_grab])
            if ale.game_over():  # terminated or truncated
                if i < self.frame_skip - 1:  # cut short: both pooled screens are the final one
                    ale.getScreenGrayscale(self._screens[0])
                    self._screens[1] = self._screens[0]
                break
        return reward

    def _push_frame(self, fill=False):
        """Max-pools, resizes and pushes the newest frame; returns the new stack (a fresh array)."""
        np.maximum(self._screens[0], self._screens[1], out=self._max_screen)
        small = self._resize(self._max_screen)
        small += 0.5  # round to nearest when the assignment below truncates to uint8
        stack = np.empty_like(self._stack)
        if fill:
            stack[:] = small
        else:
            stack[:-1] = self._stack[1:]
            stack[-1] = small
        self._stack = stack
        return stack

    def _real_reset(self, seed):
        # AtariEnv.reset seeds ALE and its np_random (used for the no-ops) when given a seed.
        self.env.reset(seed=seed)
        ale = self.ale
        num_noops = int(self.np_random.integers(1, self.noop_max + 1)) if self.noop_max > 0 else 0
        for _ in range(num_noops):
            ale.act(self._noop)
            if ale.game_over():
                ale.reset_game()
        if self._fire is not None:
            self._repeat(self._fire)
        else:
            ale.getScreenGrayscale(self._screens[0])
            self._screens[1] = self._screens[0]
        if ale.game_over():  # only a pathological ROM ends during the no-ops and FIRE
            ale.reset_game()
        self._lives = ale.lives()
        return self._push_frame(fill=True)

    def reset(self, *, seed=None, options=None):
        """Returns (uint8 [frame_stack, size, size] observation, info)."""
        if self._life_lost and seed is None:
            # A life was lost: the training episode restarts, the game goes on.
            obs = self._stack
            if self._fire is not None:
                self._repeat(self._fire)
                obs = self._push_frame()
                if self.ale.game_over():
                    obs = self._real_reset(None)
            self._lives = self.ale.lives()
        else:
            obs = self._real_reset(seed)
        self._life_lost = False
        return obs, {"lives": self._lives, "game_over": False}

    def step(self, action):
        """Returns (observation, reward, terminated, truncated, info) for one agent step
        (frame_skip frames)."""
        reward = self._repeat(self._ale_actions[action])
        obs = self._push_frame()
        ale = self.ale
        terminated = ale.game_over(with_truncation=False)
        truncated = ale.game_truncated()
        game_over = terminated or truncated
        lives = ale.lives()
        self._life_lost = self.episodic_life and lives < self._lives and not game_over
        terminated = terminated or self._life_lost
        self._lives = lives
        return obs, reward, terminated, truncated, {"lives": lives, "game_over": game_over}


def _atari_spec_kwargs(env_id):
    """The registry kwargs of an ALE screen id (ALE/Pong-v5, PongNoFrameskip-v4, ...), else None."""
    spec = gymnasium.registry.get(env_id)
    if spec is None or "ale_py" not in str(spec.entry_point):
        return None
    if spec.kwargs.get("obs_type", "rgb") == "ram":
        return None  # RAM observations are vectors: the generic path handles them
    return spec.kwargs


def _sticky_action_probability(flags, spec_kwargs):
    """--repeat_action_probability, or the id's own value (v5 and v0: 0.25, v4: 0.0) when None."""
    value = flags.repeat_action_probability
    return spec_kwargs.get("repeat_action_probability", 0.25) if value is None else value


def _make_atari(env_id, flags, render_mode=None):
    kwargs = _atari_spec_kwargs(env_id)
    atari = ale_py.AtariEnv(
        game=kwargs["game"],
        mode=kwargs.get("mode"),
        difficulty=kwargs.get("difficulty"),
        obs_type="grayscale",
        frameskip=1,
        repeat_action_probability=_sticky_action_probability(flags, kwargs),
        full_action_space=kwargs.get("full_action_space", False),
        max_num_frames_per_episode=kwargs.get("max_num_frames_per_episode", MAX_FRAMES_PER_EPISODE),
        render_mode=render_mode,  # "rgb_array": the colour screen, whatever obs_type is
    )
    return AtariPreprocessing(atari, episodic_life=bool(flags.episodic_life))


# ---------------------------------------------------------------------------------------------
# Null environment: measures the overhead of everything but the environment.


class NullEnv(gymnasium.Env):
    """Constant zero observations, 2 actions, reward 0, episodes of exactly `episode_length`
    steps."""

    def __init__(self, observation_shape=(4,), dtype=np.float32, episode_length=100):
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


if "Null-v0" not in gymnasium.registry:
    gymnasium.register("Null-v0", entry_point=NullEnv)
if "NullAtari-v0" not in gymnasium.registry:
    gymnasium.register("NullAtari-v0", entry_point=NullEnv,
                       kwargs=dict(observation_shape=(4, 84, 84), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# Old gym API, observation casts, MinAtar.


def _as_gymnasium_space(space):
    """Turns an old gym Discrete/Box space into the Gymnasium one; other spaces pass through."""
    if isinstance(space, spaces.Space):
        return space
    name = type(space).__name__
    if name == "Discrete":
        return spaces.Discrete(int(space.n))
    if name == "Box":
        return spaces.Box(space.low, space.high, space.shape, dtype=space.dtype)
    return space


class LegacyGymAPI(gymnasium.Env):
    """Gives an environment written for the old gym API the Gymnasium API.

    Old API: reset() -> obs, seed(seed), step(a) -> (obs, reward, done, info).
    New API: reset(seed=None) -> (obs, info), step(a) -> (obs, reward, terminated, truncated, info).
    `done` becomes `truncated` when the old env's TimeLimit marked it in
    info["TimeLimit.truncated"], else `terminated`. The old env need not subclass gymnasium.Env.
    """

    def __init__(self, env):
        self.env = env
        self.observation_space = _as_gymnasium_space(env.observation_space)
        self.action_space = _as_gymnasium_space(env.action_space)
        self.metadata = getattr(env, "metadata", {})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None and hasattr(self.env, "seed"):
            self.env.seed(seed)
        return self.env.reset(), {}

    def step(self, action):
        obs, reward, done, info = self.env.step(action)
        truncated = bool(done and info.get("TimeLimit.truncated", False))
        return obs, reward, bool(done) and not truncated, truncated, info

    def close(self):
        if hasattr(self.env, "close"):
            self.env.close()


def _is_legacy_reset(result):
    """New-API reset() returns (obs, info dict); the old API returns the observation alone."""
    return not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict))


class Float32Observation(gymnasium.ObservationWrapper):
    """Vector observations as float32; Discrete observations (an index) as a one-hot float32
    vector."""

    def __init__(self, env):
        super().__init__(env)
        space = env.observation_space
        self._one_hot = isinstance(space, spaces.Discrete)
        if self._one_hot:
            self._eye = np.eye(space.n, dtype=np.float32)
            self.observation_space = spaces.Box(0.0, 1.0, (space.n,), dtype=np.float32)
        else:
            self.observation_space = spaces.Box(
                space.low.astype(np.float32), space.high.astype(np.float32), space.shape,
                dtype=np.float32)

    def observation(self, observation):
        if self._one_hot:
            return self._eye[int(observation)].copy()  # a row of _eye would be a view into it
        return np.asarray(observation, dtype=np.float32)


class ChannelsFirst(gymnasium.ObservationWrapper):
    """[H, W, C] observations (MinAtar's bool planes) -> float32 [C, H, W]."""

    def __init__(self, env):
        super().__init__(env)
        height, width, channels = env.observation_space.shape
        self.observation_space = spaces.Box(0.0, 1.0, (channels, height, width), dtype=np.float32)

    def observation(self, observation):
        return np.array(observation.transpose(2, 0, 1), dtype=np.float32, order="C")


def _has_image(space):
    """An image [C, H, W] observation, or a Dict observation with an image entry."""
    if isinstance(space, spaces.Dict):
        return any(_has_image(entry) for entry in space.spaces.values())
    return space.shape is not None and len(space.shape) == 3


# The spaces a Dict observation's entries may have: arrays, which DictNet (beast/models.py)
# encodes by their rank.
DICT_ENTRY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiBinary, spaces.MultiDiscrete)


def observation_layout(space):
    """(shape, dtype) of one observation of `space`; for a Dict space, ({entry: shape},
    {entry: dtype}), one rollout field per entry (beast/rollout.py OBSERVATION_PREFIX).

    Raises ValueError naming every entry of a Dict that is not an array the models can encode
    (a Text, a nested Dict or Tuple, ...).
    """
    if not isinstance(space, spaces.Dict):
        return tuple(space.shape), np.dtype(space.dtype)
    bad = [f"{key!r} ({type(entry).__name__})" for key, entry in space.spaces.items()
           if not isinstance(key, str) or not isinstance(entry, DICT_ENTRY_SPACES)]
    if bad or not space.spaces:
        raise ValueError(
            f"the Dict observation has entries the models cannot encode: "
            f"{', '.join(bad) or 'none at all'}. Every entry must be an array space with a str "
            f"name ({', '.join(s.__name__ for s in DICT_ENTRY_SPACES)}); drop the others or "
            "turn them into arrays in a wrapper (beast/envs.py WRAPPERS)")
    return ({key: tuple(entry.shape) for key, entry in space.spaces.items()},
            {key: np.dtype(entry.dtype) for key, entry in space.spaces.items()})


def _wants_float32(space):
    """Discrete (an index) and non-float32 vector observations become float32 vectors."""
    return isinstance(space, spaces.Discrete) or (
        isinstance(space, spaces.Box) and len(space.shape) == 1 and space.dtype != np.float32)


class Float32DictEntries(gymnasium.ObservationWrapper):
    """What Float32Observation does to a whole observation, to each entry of a Dict that needs
    it: Discrete entries become one-hot float32 vectors, other vectors float32."""

    def __init__(self, env):
        super().__init__(env)
        entries = dict(env.observation_space.spaces)
        self._one_hot, self._cast = {}, []
        for key, space in entries.items():
            if isinstance(space, spaces.Discrete):
                self._one_hot[key] = (np.eye(space.n, dtype=np.float32), int(space.start))
                entries[key] = spaces.Box(0.0, 1.0, (int(space.n),), dtype=np.float32)
            elif _wants_float32(space):
                self._cast.append(key)
                entries[key] = spaces.Box(space.low.astype(np.float32),
                                          space.high.astype(np.float32), space.shape, np.float32)
        self.observation_space = spaces.Dict(entries)

    def observation(self, observation):
        observation = dict(observation)
        for key, (eye, start) in self._one_hot.items():
            observation[key] = eye[int(observation[key]) - start].copy()
        for key in self._cast:
            observation[key] = np.asarray(observation[key], dtype=np.float32)
        return observation


def _render_kwargs(render_mode):
    # Not render_mode=None: gymnasium.make passes it on, and an env without the argument fails.
    return {} if render_mode is None else {"render_mode": render_mode}


def _make_registered(env_id, render_mode=None):
    """gymnasium.make(env_id), with LegacyGymAPI for old-API envs and float32 vector observations.

    Old-API detection: one reset() of the unwrapped env at creation; if it returns the observation
    alone instead of an (observation, info) pair, the env is rebuilt as LegacyGymAPI + TimeLimit.
    gymnasium.make refuses an env class that does not subclass gymnasium.Env (TypeError); such
    classes (old gym.Env subclasses) are instantiated from the registry entry and wrapped the
    same way.
    """
    spec = gymnasium.spec(env_id)
    try:
        env = gymnasium.make(env_id, disable_env_checker=True, **_render_kwargs(render_mode))
        raw = env.unwrapped
    except TypeError:
        creator = spec.entry_point
        if not callable(creator):
            creator = gymnasium.envs.registration.load_env_creator(creator)
        env = raw = creator(**spec.kwargs)
        if isinstance(raw, gymnasium.Env):
            raise  # a real TypeError, not the old-API case
    if _is_legacy_reset(raw.reset()):
        env = LegacyGymAPI(raw)
        if spec.max_episode_steps is not None:
            env = gymnasium.wrappers.TimeLimit(env, spec.max_episode_steps)
    space = env.observation_space
    if _wants_float32(space):
        env = Float32Observation(env)
    elif isinstance(space, spaces.Dict) and any(map(_wants_float32, space.spaces.values())):
        env = Float32DictEntries(env)
    return env


def _make_minatar(env_id, render_mode=None):
    try:
        import minatar.gym
    except ImportError as error:
        raise ValueError(f"Environment {env_id!r} needs the MinAtar package: "
                         "pip install minatar") from error
    if env_id not in gymnasium.registry:
        minatar.gym.register_envs()
    if env_id not in gymnasium.registry:
        raise ValueError(f"Unknown MinAtar id {env_id!r}; MinAtar ids are: "
                         f"{', '.join(MINATAR_IDS)}")
    return ChannelsFirst(gymnasium.make(env_id, disable_env_checker=True,
                                        **_render_kwargs(render_mode)))


# ---------------------------------------------------------------------------------------------
# EnvPool backend (optional).


def _import_envpool():
    try:
        import envpool
    except ImportError as error:
        raise ValueError("--env_backend envpool needs the EnvPool package: "
                         "pip install envpool") from error
    return envpool


def create_envpool(flags, num_envs, batch_size=None, seed=None, num_threads=1):
    """EnvPool's own batched Atari env (Gymnasium API, leading dim = batch), preprocessed as ours.

    Gray 84x84, 4-frame stack, frame skip 4, up to 30 no-op starts, FIRE on reset, no reward
    clipping, flags.episodic_life, the id's sticky-action probability, 27000 steps per episode.
    Seeded with `seed` (default flags.seed) at creation; EnvPool cannot be reseeded by reset.
    num_threads: EnvPool's C++ threads; 1 by default, because each of our actors (or server
    streams) already gets a core of its own. Its info holds
    "terminated" (the real game ended) and "lives". EnvPool resets an env itself on the step after
    that env's episode ended, ignoring that step's action.
    """
    envpool = _import_envpool()
    kwargs = _atari_spec_kwargs(flags.env)
    match = re.fullmatch(r"(?:ALE/)?([A-Za-z]+?)(?:NoFrameskip)?-v\d+", flags.env)
    if kwargs is None or match is None:
        raise ValueError("--env_backend envpool supports Atari ids only (ALE/Pong-v5, "
                         f"PongNoFrameskip-v4), got {flags.env!r}")
    if WRAPPERS:
        names = ", ".join(getattr(w, "__name__", repr(w)) for w in WRAPPERS)
        raise ValueError("--env_backend envpool steps its games in C++ and cannot apply the "
                         f"wrappers in beast/envs.py WRAPPERS ({names}); use --env_backend "
                         "gymnasium")
    return envpool.make(
        f"{match.group(1)}-v5", env_type="gymnasium", num_envs=num_envs,
        batch_size=batch_size or num_envs,
        num_threads=num_threads,
        seed=(flags.seed if seed is None else int(seed)) % 2**31,
        episodic_life=bool(flags.episodic_life),
        reward_clip=False, stack_num=4, gray_scale=True, img_height=84, img_width=84, frame_skip=4,
        noop_max=30, use_fire_reset=True,
        repeat_action_probability=_sticky_action_probability(flags, kwargs),
        max_episode_steps=MAX_FRAMES_PER_EPISODE // 4,
    )


class EnvPoolSingle(gymnasium.Env):
    """One EnvPool env (num_envs=1) as a plain Gymnasium env, so that RolloutAdapter can drive
    it."""

    def __init__(self, pool):
        self.pool = pool
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


# ---------------------------------------------------------------------------------------------
# Entry points.


def _unknown_env_message(env_id):
    candidates = list(gymnasium.registry) + list(MINATAR_IDS)
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(env_id.lower(), list(by_lower), n=4, cutoff=0.6)
    suggestion = f" Did you mean {', '.join(by_lower[c] for c in close)}?" if close else ""
    return (
        f"Unknown environment id {env_id!r}.{suggestion}\n"
        "create_env accepts:\n"
        "  Atari: ALE/<Game>-v5 or <Game>NoFrameskip-v4, e.g. ALE/Pong-v5 (pip install ale-py)\n"
        "  classic control / Box2D / MuJoCo: e.g. CartPole-v1, LunarLander-v3 "
        "(pip install gymnasium, gymnasium[box2d], gymnasium[mujoco])\n"
        "  MinAtar: MinAtar/<Game>-v1, e.g. MinAtar/Breakout-v1 (pip install minatar)\n"
        "  Null-v0, NullAtari-v0: constant observations, to measure the system's overhead\n"
        "  any Gymnasium id that a package registers on import: some.module:EnvId-v0"
    )


def create_env(flags, render_mode=None):
    """Creates one environment for training or evaluation, wrapped in WRAPPERS.

    flags: argparse.Namespace with the environment flags (beast/flags.py add_env_flags):
      env (str): the environment id (see the module docstring for the accepted ids).
      episodic_life (bool): Atari only; a training episode ends at each life loss, the game
        (and the logged episode return) goes on until game over. None, before
        apply_env_defaults has chosen it (env_info, which finds the kind), is off.
      env_backend (str): "gymnasium", or "envpool" to step the Atari emulator in EnvPool's C++.
      repeat_action_probability (float or None): Atari sticky actions; None keeps
        the id's own value (ALE/*-v5: 0.25, *-v4: 0.0).
    render_mode: None (training: no rendering cost), or Gymnasium's "rgb_array" for an env
      whose render() returns the screen (beast/video.py); such an env is always stepped by
      Gymnasium, as EnvPool renders no colour screen (the same game and preprocessing).
    Seeding is the caller's: RolloutAdapter(env, seed) seeds the first reset.
    Returns a gymnasium.Env. Raises ValueError for an unknown id or a missing package.
    """
    backend = flags.env_backend
    if backend == "envpool" and render_mode is None:
        return EnvPoolSingle(create_envpool(flags, num_envs=1))
    if backend not in ("gymnasium", "envpool"):
        raise ValueError(f"Unknown --env_backend {backend!r}: use gymnasium or envpool")
    env = _make_env(flags, render_mode)
    for wrapper in WRAPPERS:
        env = wrapper(env)
    return env


def _make_env(flags, render_mode=None):
    """The environment of flags.env before WRAPPERS."""
    env_id = flags.env
    if env_id.startswith("MinAtar/"):
        return _make_minatar(env_id, render_mode)
    if ":" in env_id:
        # Gymnasium's convention: "package.module:EnvId" imports the module, which registers its
        # ids.
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not (module + ".").startswith(error.name + "."):
                _raise_from_env_code(flags.env, f"importing the module {module!r}", error)
            raise ValueError(f"Cannot import {module!r} for environment {env_id!r}: "
                             f"{error}") from error
        except Exception as error:  # a syntax error, or anything its code raised
            _raise_from_env_code(flags.env, f"importing the module {module!r}", error)
    if env_id in ("Null-v0", "NullAtari-v0"):
        spec = gymnasium.spec(env_id)
        return NullEnv(**spec.kwargs)  # without gymnasium.make's wrappers, which would add overhead
    if env_id not in gymnasium.registry:
        raise ValueError(_unknown_env_message(env_id))
    if _atari_spec_kwargs(env_id) is not None:
        return _make_atari(env_id, flags, render_mode)
    try:
        return _make_registered(env_id, render_mode)
    except Exception as error:  # the environment's own constructor, or its entry point's module
        entry_point = gymnasium.spec(env_id).entry_point
        if not isinstance(entry_point, str):  # a class or function: module:name
            entry_point = f"{entry_point.__module__}:{entry_point.__qualname__}"
        _raise_from_env_code(flags.env, f"creating {env_id!r} (entry point {entry_point})", error)


def _raise_from_env_code(env_flag, doing, error):
    """The environment's own code (its module, its constructor) raised `error` while we were
    `doing` something: its traceback goes to stderr as it is, then a ValueError names the
    environment and the module, which the entry points print as their one message."""
    traceback.print_exception(error)
    raise ValueError(
        f"--env {env_flag}: {doing} raised {type(error).__name__}: {error} (its traceback is "
        "above). Fix the environment's code, or check that --env names the environment you "
        "mean (module:EnvId)") from error


def env_kind(env):
    """"atari" when our Atari preprocessing (or EnvPool's) is anywhere inside `env`, whatever wraps
    it; otherwise "image" for [C, H, W] observations, "continuous" for other observations with a
    Box action space (continuous control: Pendulum, MuJoCo) and "vector" for the rest. The kind
    picks the defaults of beast/flags.py; the action space alone picks the policy head, so an
    image env with a Box action space gets the image defaults and a Gaussian policy."""
    layer = env
    while layer is not None:
        if isinstance(layer, (AtariPreprocessing, EnvPoolSingle)):
            return "atari"
        layer = getattr(layer, "env", None)
    if _has_image(env.observation_space):
        return "image"
    return "continuous" if isinstance(env.action_space, spaces.Box) else "vector"


def env_info(flags):
    """What the learner needs to build the model, read from one environment created and closed here.

    Returns dict(observation_shape: tuple, observation_dtype: np.dtype (for a Dict observation
    {entry: shape} and {entry: dtype}, see observation_layout), num_actions: int,
    continuous: bool, action_low and action_high, kind: "atari" | "image" | "continuous" |
    "vector" (see env_kind), env_fields: the rollout fields the environment side writes
    (beast/rollout.py)). For a Discrete action space num_actions is its size and the bounds are
    None; for a Box of shape [A] (continuous) num_actions is A and the bounds are its float64
    [A] low and high. Raises ValueError for another action space or a bad rollout_fields
    declaration.
    """
    env = create_env(flags)
    try:
        adapter = RolloutAdapter(env)
        box = adapter.box
        return dict(
            observation_shape=adapter.observation_shape,
            observation_dtype=adapter.observation_dtype,
            num_actions=adapter.num_actions,
            continuous=box is not None,
            action_low=None if box is None else box.space_low,
            action_high=None if box is None else box.space_high,
            kind=env_kind(env),
            env_fields=adapter.fields,
        )
    finally:
        env.close()


class BoxActions:
    """The agent's actions for a one-dimensional Box action space of shape [A].

    The agent acts in [-1, 1] per dimension whatever the bounds (an initial std of 1 then
    explores every action range alike). to_env clips an action to [-1, 1] and maps it
    affinely onto the Box's [low, high]; a dimension with an infinite bound passes as it is.
    Clipped rather than squashed with tanh: the rollout keeps the unclipped sample, whose
    log-density is the Gaussian's own, so V-trace's importance weights and the entropy term
    stay exact (a tanh squash needs the log-det of its Jacobian in every log-probability, and
    its entropy has no closed form). The policy's mean stays inside [-1, 1] (beast/models.py);
    only its samples are clipped.
    """

    def __init__(self, space, env=None):
        if len(space.shape) != 1:
            raise ValueError(f"Environment {env} has the Box action space {space}; only "
                             "one-dimensional Box action spaces [A] are supported")
        self.size = int(space.shape[0])
        self.dtype = space.dtype
        self.space_low = space.low.astype(np.float64)
        self.space_high = space.high.astype(np.float64)
        bounded = np.isfinite(self.space_low) & np.isfinite(self.space_high)
        # to_env is clip(action, clip_low, clip_high) * scale + center, dimension by dimension:
        # [-1, 1] onto [low, high] where both bounds are finite, the identity elsewhere.
        self._clip_low = np.where(bounded, -1.0, -np.inf).astype(np.float32)
        self._clip_high = np.where(bounded, 1.0, np.inf).astype(np.float32)
        low = np.where(bounded, self.space_low, 0.0)
        high = np.where(bounded, self.space_high, 0.0)
        self._scale = np.where(bounded, (high - low) / 2, 1.0).astype(np.float32)
        self._center = ((high + low) / 2).astype(np.float32)

    def agent_action(self, action):
        """The agent's action (array-like, A numbers) as a fresh float32 [A] array."""
        action = np.array(action, dtype=np.float32)
        if action.shape != (self.size,):
            action = action.reshape(self.size)  # a [1, A] row, say; a wrong size raises here
        return action

    def to_env(self, action):
        """The Box action (a new array, [A], the space's dtype) for the agent's float32 [A]
        action."""
        env_action = action.clip(self._clip_low, self._clip_high) * self._scale + self._center
        return env_action if env_action.dtype == self.dtype else env_action.astype(self.dtype)


class RolloutAdapter:
    """Steps a Gymnasium env and returns each step in the rollout format (numpy values, no
    batch dims).

    initial() / step(action) return a dict with one entry per env field of beast/rollout.py:
      frame          observation, as the env returns it (uint8 [4, 84, 84] for Atari,
                     float32 [obs_dim] for vector tasks); every env from create_env returns a
                     fresh array each step, which the caller may keep; a Dict observation
                     gives one field frame/<key> per entry instead (observation_layout),
      reward         float32, the reward of the step that led here (0 at initial()),
      done           bool, this step ended a training episode (True at initial()),
      truncated      bool, this step was cut short by a time limit (see below),
      game_over      bool, this step ended the real game (info["game_over"] when the env gives it,
                     as end-of-life episodes do; else == done; False at initial()),
      episode_return float32, the real game's return so far; at game_over the finished game's total,
      episode_step   int32, the real game's steps so far; at game_over the finished game's length,
      last_action    int64, the action that led here (0 at initial()); with a Box action space,
                     float32 [A], the agent's action as step() got it, before BoxActions clips it,
    plus the fields that the env or its wrappers declare in `rollout_fields`, read from the info
    dict of each step (required) and of reset() (zeros when absent).
    When a step ends an episode, step() resets the env: the frame returned is the next episode's
    first, while reward, episode_return, episode_step and the declared fields describe the step
    and game that ended. A time limit (truncated and not terminated) is the exception: that
    step returns the final observation with truncated=True and done=False, so that the learner
    can bootstrap from its value, and the next step() ignores its action and returns initial().
    """

    def __init__(self, gym_env, seed=None):
        space = gym_env.action_space
        # A Box action space: step() takes the agent's float32 [A] actions (see BoxActions).
        self.box = BoxActions(space, gym_env) if isinstance(space, spaces.Box) else None
        if self.box is None and not isinstance(space, spaces.Discrete):
            raise ValueError(
                f"Environment {gym_env} has action space {space}; only Discrete action spaces "
                "(a softmax policy) and one-dimensional Box ones (a Gaussian policy) are supported")
        self.env = gym_env
        self.seed = seed
        self.observation_space = gym_env.observation_space
        self.observation_shape, self.observation_dtype = observation_layout(
            gym_env.observation_space)
        # A Dict observation's (entry, field name, dtype), one field per entry; None otherwise.
        self._entries = None if not isinstance(self.observation_shape, dict) else tuple(
            (key, rollout.OBSERVATION_PREFIX + key, dtype)
            for key, dtype in self.observation_dtype.items())
        self.num_actions = self.box.size if self.box else int(space.n)
        self.extra_fields = rollout.declared_fields(gym_env)
        self.fields = rollout.core_env_fields(
            self.observation_shape, self.observation_dtype,
            self.num_actions if self.box else None) + self.extra_fields
        if seed is not None:
            gym_env.action_space.seed(seed)
        # The seed goes to the first reset only; later resets continue its RNG.
        self._seed_pending = True
        self._reset_pending = False
        self._episode_return = 0.0
        self._episode_step = 0
        self._closed = False

    def initial(self):
        seed = self.seed if self._seed_pending else None
        self._seed_pending = False
        self._reset_pending = False
        frame, info = self.env.reset(seed=seed)
        self._episode_return = 0.0
        self._episode_step = 0
        output = dict(
            frame=frame,
            reward=np.float32(0.0),
            done=np.bool_(True),
            truncated=np.bool_(False),
            game_over=np.bool_(False),
            episode_return=np.float32(0.0),
            episode_step=np.int32(0),
            last_action=np.int64(0) if self.box is None else np.zeros(self.box.size, np.float32),
        )
        if self.extra_fields:
            self._add_declared(output, info, required=False)
        if self._entries is not None:
            self._put_entries(output, output.pop("frame"))
        return output

    def step(self, action):
        if self._reset_pending:  # the last step returned a time limit's final observation
            return self.initial()
        if self.box is None:
            # NumPy's int64, what action_space.sample() gives: Gymnasium's Discrete.contains,
            # which many envs assert on every step, takes twice as long for a Python int.
            action = np.int64(int(action))  # int(): a size-1 array from the wire is fine too
            env_action = action
        else:
            action = self.box.agent_action(action)
            env_action = self.box.to_env(action)
        frame, reward, terminated, truncated, info = self.env.step(env_action)
        done = terminated or truncated
        game_over = info.get("game_over", done)
        # Cut short by a time limit: this step returns the final observation (so that the
        # learner can bootstrap from its value) and the next one, whatever its action, the
        # next episode's first.
        self._reset_pending = bool(truncated and not terminated)
        if self._reset_pending:
            done = False
        self._episode_return += reward
        self._episode_step += 1
        episode_return = self._episode_return
        episode_step = self._episode_step
        if game_over:
            self._episode_return = 0.0
            self._episode_step = 0
        output = dict(
            reward=np.float32(reward),
            done=np.bool_(done),
            truncated=np.bool_(self._reset_pending),
            game_over=np.bool_(game_over),
            episode_return=np.float32(episode_return),
            episode_step=np.int32(episode_step),
            last_action=action,
        )
        if self.extra_fields:
            self._add_declared(output, info, required=True)
        if done:
            frame, _ = self.env.reset()
        if self._entries is None:
            output["frame"] = frame
        else:
            self._put_entries(output, frame)
        return output

    def _put_entries(self, output, observation):
        """A Dict observation's entries into `output`, each under its field's name."""
        for key, name, dtype in self._entries:
            output[name] = np.asarray(observation[key], dtype=dtype)

    def _add_declared(self, output, info, required):
        for field in self.extra_fields:
            if field.name not in info:
                if required:
                    raise KeyError(f"{self.env} declares the rollout field {field.name!r} but its "
                                   "step() info has no such key")
                output[field.name] = np.zeros(field.shape, field.dtype)
                continue
            value = np.asarray(info[field.name], dtype=field.dtype)
            if value.shape != field.shape:
                raise ValueError(f"rollout field {field.name!r} has shape {value.shape}, declared "
                                 f"{field.shape}")
            output[field.name] = value

    def close(self):
        """Closes the env; calling it again does nothing."""
        if not self._closed:
            self._closed = True
            self.env.close()
