"""Environments: `create_env`, `WRAPPERS`, `env_info` and the adapter to the rollout format.

This is the file to edit to train on another environment. MonoBeast's actors and PolyBeast's
environment servers both build their environments with `create_env(flags)` and step them through
`RolloutAdapter`, so a change here reaches both variants.

Data path of one actor step:

    action (int; float32 [A] for a Box action space, see BoxActions)
                 -> RolloutAdapter.step -> gym_env.step (WRAPPERS -> our casts -> the env)
                 -> dict(frame, reward, done, game_over, episode_return, episode_step, last_action)

Which ids `create_env` accepts:
  * Atari: `ALE/<Game>-v5` (sticky actions, repeat_action_probability 0.25) and the old
    `<Game>NoFrameskip-v4` / `<Game>-v4` (no sticky actions) and `-v0` (0.25) ids, with
    DeepMind-style preprocessing (beast/atari_wrappers.py: no-op starts, frame skip 4 with
    max-pooling, 84x84 grayscale, 4-frame stack, FIRE on reset, optional end-of-life episodes);
    with --env_backend envpool, EnvPool's C++ does the same (beast/envpool_backend.py).
  * MinAtar: `MinAtar/<Game>-v0|v1` (pip install minatar), channels-first float32 frames
    (beast/minatar_env.py).
  * NetHack: the NetHack Learning Environment's ids (the nle package), `NetHackScore-v0`,
    `NetHackChallenge-v0` and the task suite (NETHACK_IDS), as a Dict of the entries that
    --model nethack reads, its games seeded from the first reset's seed (beast/nethack_env.py).
  * Any other id in Gymnasium's registry (CartPole-v1, LunarLander-v3, ...), also
    `some.module:EnvId-v0`, which imports `some.module` first so that it can register its ids
    (the benchmarks' null environment is `bench.null_env:Null-v0`).
    Vector observations are cast to float32, Discrete observations become one-hot float32 vectors.
    A Dict observation (array entries only: see observation_layout) becomes one rollout field per
    entry, frame/<key>, each entry cast as above.
  * Environments written for the old gym API (reset() -> obs; step() -> (obs, reward, done, info))
    are detected and wrapped in `LegacyGymAPI` (see `create_env`).

Only numpy and gymnasium are imported; each family's module beside this one (Atari, EnvPool,
MinAtar, NetHack) and its package are imported when a run makes one of its environments.
"""

import difflib
import importlib
import traceback

import gymnasium
import numpy as np
from gymnasium import spaces

from beast import rollout

# Wrappers put around every environment that create_env makes (the first one innermost), for
# training, evaluation and env servers alike. Each is called as wrapper(env) and returns the
# wrapped env: a gymnasium.Wrapper subclass, or a function. To add one, write it and list it
# here, e.g. WRAPPERS = (gymnasium.wrappers.TransformReward,) with its arguments bound by
# functools.partial. A wrapper may add rollout fields of its own (beast/rollout.py,
# `rollout_fields`). The envpool backend steps its games in C++ and cannot apply them: it
# refuses to start while this list is not empty (check_backend).
WRAPPERS = ()

MINATAR_IDS = tuple(
    f"MinAtar/{game}-{version}"
    for game in ("Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders")
    for version in ("v0", "v1")
)

# The ids that the nle package registers: the whole game rewarded by its score (Score, and
# NetHack-v0 with the full keyboard and no penalty for idle steps), the NetHack Challenge's
# (Challenge: every key, a random character, menus not skipped) and the task suite.
NETHACK_IDS = tuple(
    f"NetHack{task}-v0"
    for task in ("Score", "Challenge", "Staircase", "StaircasePet", "Oracle", "Gold", "Eat",
                 "Scout", "")
)


# ---------------------------------------------------------------------------------------------
# Entry points.


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
      full_action_space (bool or None, optional): Atari: all 18 joystick actions; None keeps
        the id's own set (the game's minimal one).
      noop_max (int or None, optional): Atari: at most this many no-op frames at the start
        of a game (0: none); None: 30.
      penalty_step (float or None, optional): NetHack's reward on a step where the game's
        clock stands still; None: beast/nethack_env.py default_penalty_step.
    render_mode: None (training: no rendering cost), or Gymnasium's "rgb_array" for an env
      whose render() returns the screen (beast/video.py); such an env is always stepped by
      Gymnasium, as EnvPool renders no colour screen (the same game and preprocessing).
    Seeding is the caller's: RolloutAdapter(env, seed) seeds the first reset.
    Returns a gymnasium.Env. Raises ValueError for an unknown id or a missing package.
    """
    check_backend(flags)
    if flags.env_backend == "envpool" and render_mode is None:
        from beast import envpool_backend  # EnvPool loads only for the runs that ask for it

        return envpool_backend.EnvPoolSingle(envpool_backend.create_envpool(flags, num_envs=1))
    env = _make_env(flags, render_mode)
    for wrapper in WRAPPERS:
        env = wrapper(env)
    return env


def check_backend(flags):
    """Raises ValueError for an unknown flags.env_backend, and for envpool with another
    family's flags (EnvPool plays Atari only) or while WRAPPERS is not empty: EnvPool steps
    its games in C++ and cannot apply them."""
    backend = flags.env_backend
    if backend not in ("gymnasium", "envpool"):
        raise ValueError(f"Unknown --env_backend {backend!r}: use gymnasium or envpool")
    if backend == "envpool":
        _refuse_flags_of_other_families(flags, "atari")
    if backend == "envpool" and WRAPPERS:
        names = ", ".join(getattr(w, "__name__", repr(w)) for w in WRAPPERS)
        raise ValueError("--env_backend envpool steps its games in C++ and cannot apply the "
                         f"wrappers in beast/envs.py WRAPPERS ({names}); use --env_backend "
                         "gymnasium")


def _make_env(flags, render_mode=None):
    """The environment of flags.env before WRAPPERS."""
    env_id = flags.env
    if ":" in env_id:
        env_id = _import_env_module(env_id)
    family = _family(env_id)
    _refuse_flags_of_other_families(flags, family)
    make_kwargs = _render_kwargs(render_mode)
    # Each family's module loads only for its own runs.
    if family == "minatar":
        from beast import minatar_env

        return minatar_env.make_minatar(env_id, **make_kwargs)
    if family == "nethack":
        from beast import nethack_env

        return nethack_env.make_nethack(env_id, getattr(flags, "penalty_step", None),
                                        **make_kwargs)
    if family == "atari":
        from beast import atari_wrappers

        return atari_wrappers.make_atari(env_id, flags, render_mode)
    try:
        return _make_registered(env_id, render_mode)
    except Exception as error:  # the environment's own constructor, or its entry point's module
        entry_point = gymnasium.spec(env_id).entry_point
        if not isinstance(entry_point, str):  # a class or function: module:name
            entry_point = f"{entry_point.__module__}:{entry_point.__qualname__}"
        _raise_from_env_code(flags.env, f"creating {env_id!r} (entry point {entry_point})", error)


def _import_env_module(env_flag):
    """Gymnasium's convention: "package.module:EnvId" imports the module, which registers its
    ids. Returns EnvId."""
    module, env_id = env_flag.split(":", 1)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not (module + ".").startswith(error.name + "."):
            _raise_from_env_code(env_flag, f"importing the module {module!r}", error)
        raise ValueError(f"Cannot import {module!r} for environment {env_id!r}: "
                         f"{error}") from error
    except Exception as error:  # a syntax error, or anything its code raised
        _raise_from_env_code(env_flag, f"importing the module {module!r}", error)
    return env_id


def _family(env_id):
    """"minatar", "nethack", "atari" (an ALE screen id) or "gymnasium" (any other registered
    id); ValueError for an id nobody registers."""
    if env_id.startswith("MinAtar/"):
        return "minatar"
    if env_id in NETHACK_IDS:
        return "nethack"
    if not _registered(env_id):
        raise ValueError(_unknown_env_message(env_id))
    if "ale_py" in str(gymnasium.spec(env_id).entry_point):
        from beast import atari_wrappers

        if atari_wrappers.atari_spec_kwargs(env_id) is not None:  # RAM ids are vectors
            return "atari"
    return "gymnasium"


# The environment flags that only one family's environments read (beast/flags.py
# add_env_flags; None unless given, and episodic_life False for every other kind).
FAMILY_FLAGS = {"atari": ("repeat_action_probability", "full_action_space", "noop_max",
                          "episodic_life"),
                "nethack": ("penalty_step",)}


def _refuse_flags_of_other_families(flags, family):
    """ValueError for a flag of FAMILY_FLAGS given with another family's environment. None
    and False are not given: False asks for what the other families do anyway."""
    for owner, names in FAMILY_FLAGS.items():
        # getattr: flags built by hand (a server script's Namespace) may leave them out.
        given = [name for name in names
                 if getattr(flags, name, None) is not None and getattr(flags, name) is not False]
        if owner != family and given:
            raise ValueError(f"--{given[0]} is for {owner} environments only, and --env "
                             f"{flags.env} is not one: leave it out")


def _registered(env_id):
    """Whether env_id is in Gymnasium's registry, ALE's ids included: importing
    beast/atari_wrappers.py registers them, and it is imported only for an id not found first."""
    if env_id not in gymnasium.registry:
        try:
            from beast import atari_wrappers  # noqa: F401 (registers ALE's ids)
        except ImportError as error:
            if error.name != "ale_py":  # no ale_py: no ALE ids to find; anything else breaks
                raise
    return env_id in gymnasium.registry


def _unknown_env_message(env_id):
    candidates = list(gymnasium.registry) + list(MINATAR_IDS) + list(NETHACK_IDS)
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
        "  NetHack: NetHackScore-v0, NetHackChallenge-v0 and the tasks NetHackStaircase-v0, "
        "NetHackStaircasePet-v0, NetHackOracle-v0, NetHackGold-v0, NetHackEat-v0, "
        "NetHackScout-v0 (pip install --no-deps nle)\n"
        "  any Gymnasium id that a package registers on import: some.module:EnvId-v0, e.g. "
        "bench.null_env:Null-v0 (constant observations, to measure the system's overhead)"
    )


def _raise_from_env_code(env_flag, doing, error):
    """The environment's own code (its module, its constructor) raised `error` while we were
    `doing` something: its traceback goes to stderr as it is, then a ValueError names the
    environment and the module, which the entry points print as their one message."""
    traceback.print_exception(error)
    raise ValueError(
        f"--env {env_flag}: {doing} raised {type(error).__name__}: {error} (its traceback is "
        "above). Fix the environment's code, or check that --env names the environment you "
        "mean (module:EnvId)") from error


def fill_family_flags(flags):
    """Gives the family flags (FAMILY_FLAGS) of flags.env that are still None the values its
    environments take, so that flags.json and the env servers' command lines record them: the
    id's action set and NOOP_MAX no-op starts (Atari), the task's still-step penalty
    (NetHack). Call it once flags.env is known to exist (after env_info). Returns flags."""
    env_id = flags.env.split(":")[-1]
    family = _family(env_id)
    if family == "nethack" and flags.penalty_step is None:
        from beast import nethack_env

        flags.penalty_step = nethack_env.default_penalty_step(env_id)
    if family == "atari":
        from beast import atari_wrappers

        if flags.full_action_space is None:
            flags.full_action_space = atari_wrappers.full_action_space(
                flags, atari_wrappers.atari_spec_kwargs(env_id))
        if flags.noop_max is None:
            flags.noop_max = atari_wrappers.NOOP_MAX
    return flags


def env_kind(env):
    """"atari" when our Atari preprocessing (or EnvPool's) is anywhere inside `env`, whatever wraps
    it ("sticky_atari" when its emulator repeats actions); "nethack" when NetHackEnv is (every
    NetHack env from create_env); otherwise "image" for [C, H, W] observations, "continuous"
    for other observations with a Box action space (continuous control: Pendulum, MuJoCo) and
    "vector" for the rest. The kind picks the defaults of beast/flags.py; the action space
    alone picks the policy head, so an image env with a Box action space gets the image
    defaults and a Gaussian policy."""
    layer = env
    while layer is not None:
        # AtariPreprocessing, EnvPoolSingle and NetHackEnv name their kind.
        kind = getattr(layer, "env_kind", None)
        if kind is not None:
            return kind
        layer = getattr(layer, "env", None)
    if _has_image(env.observation_space):
        return "image"
    return "continuous" if isinstance(env.action_space, spaces.Box) else "vector"


def env_info(flags):
    """What the learner needs to build the model, read from one environment created and closed here.

    Returns dict(observation_shape: tuple, observation_dtype: np.dtype (for a Dict observation
    {entry: shape} and {entry: dtype}, see observation_layout), num_actions: int,
    continuous: bool, action_low and action_high, kind: "atari" | "sticky_atari" |
    "nethack" | "image" | "continuous" | "vector" (see env_kind), env_fields: the rollout
    fields the environment side writes (beast/rollout.py)). For a Discrete action space
    num_actions is its size and the bounds are None; for a Box of shape [A] (continuous)
    num_actions is A and the bounds are its float64 [A] low and high. Raises ValueError for
    another action space or a bad rollout_fields declaration.
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


# ---------------------------------------------------------------------------------------------
# The adapter to the rollout format.


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


# ---------------------------------------------------------------------------------------------
# How _make_env makes the other registered environments: the old gym API, observation casts.


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
