"""Atari preprocessing as in DeepMind's and OpenAI's wrappers, for `ALE/<Game>-v5` and the old
`<Game>NoFrameskip-v4` / `<Game>-v4` / `-v0` ids.

    agent action -> AtariPreprocessing.step -> frame_skip x ale.act (sticky actions inside ALE)
                 -> max-pool of the last two grayscale screens -> 84x84 (OpenCV's INTER_AREA)
                 -> uint8 [4, 84, 84] stack, oldest frame first

Whatever the id, the emulator runs with frameskip 1 and AtariPreprocessing does no-op starts,
frame skip 4 with max-pooling, 84x84 grayscale, the 4-frame stack, FIRE on reset and optional
end-of-life episodes. beast/envs.py `create_env` builds it with `make_atari`; the EnvPool backend
(beast/envpool_backend.py) asks EnvPool's C++ for the same preprocessing. Why our own wrapper
and not Gymnasium's AtariPreprocessing: docs/defaults.md ("The Atari screen").

Only numpy, OpenCV, gymnasium and ale_py are imported.
"""

import ale_py
import cv2
import gymnasium
import numpy as np
from gymnasium import spaces

# The ALE/* and *NoFrameskip-v4 ids in Gymnasium's registry, which atari_spec_kwargs reads.
gymnasium.register_envs(ale_py)

# ALE's cap on an episode: 108000 frames (30 minutes of play), i.e. 27000 agent steps at frame
# skip 4.
MAX_FRAMES_PER_EPISODE = 108_000
# No-op starts: up to this many frames of NOOP at the start of a game (DeepMind's preprocessing),
# so that a fixed sequence of actions does not replay one game; --noop_max changes it.
NOOP_MAX = 30


def resize_screen(screen, size):
    """uint8 [H, W] -> a new uint8 [size, size]: each pixel the mean of the input area it covers
    (input pixels partly covered weighted by the covered fraction), rounded. OpenCV's INTER_AREA,
    which runs on the calling thread for a screen this small (bench/resize.py)."""
    return cv2.resize(screen, (size, size), interpolation=cv2.INTER_AREA)


class AtariPreprocessing(gymnasium.Wrapper):
    """DeepMind-style Atari preprocessing over an `ale_py.AtariEnv` made with frameskip=1.

    Per agent step: repeat the action for `frame_skip` frames, summing the rewards; max-pool the
    last two grayscale screens (Atari sprites flicker between frames); shrink to `screen_size`^2
    by area averaging (`resize_screen`); push onto a stack of the `frame_stack` newest frames.

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

    def __init__(self, env, noop_max=NOOP_MAX, frame_skip=4, frame_stack=4, screen_size=84,
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
        # beast/envs.py env_kind: the kind whose defaults a run takes.
        self.env_kind = sticky_kind(self.ale.getFloat("repeat_action_probability"))
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
        self.screen_size = screen_size
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
        small = resize_screen(self._max_screen, self.screen_size)
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


def atari_spec_kwargs(env_id):
    """The registry kwargs of an ALE screen id (ALE/Pong-v5, PongNoFrameskip-v4, ...), else None."""
    spec = gymnasium.registry.get(env_id)
    if spec is None or "ale_py" not in str(spec.entry_point):
        return None
    if spec.kwargs.get("obs_type", "rgb") == "ram":
        return None  # RAM observations are vectors: the generic path handles them
    return spec.kwargs


def sticky_action_probability(flags, spec_kwargs):
    """--repeat_action_probability, or the id's own value (v5 and v0: 0.25, v4: 0.0) when None."""
    value = flags.repeat_action_probability
    return spec_kwargs.get("repeat_action_probability", 0.25) if value is None else value


def sticky_kind(probability):
    """The kind of environment (beast/flags.py KIND_LABELS) of Atari at this sticky-action
    probability: sticky actions learn best with defaults of their own."""
    return "sticky_atari" if probability > 0 else "atari"


def full_action_space(flags, spec_kwargs):
    """--full_action_space, or the id's own action set (the game's minimal one) when None."""
    value = getattr(flags, "full_action_space", None)  # None also where flags are built by hand
    return bool(spec_kwargs.get("full_action_space", False) if value is None else value)


def noop_max(flags):
    """--noop_max, or 30 no-op frames at most when None."""
    value = getattr(flags, "noop_max", None)  # None also where flags are built by hand
    return NOOP_MAX if value is None else value


def make_atari(env_id, flags, render_mode=None):
    """The emulator of an ALE screen id (frameskip 1, the id's game, mode and action set) in
    AtariPreprocessing, with flags.repeat_action_probability, full_action_space, noop_max and
    episodic_life."""
    kwargs = atari_spec_kwargs(env_id)
    atari = ale_py.AtariEnv(
        game=kwargs["game"],
        mode=kwargs.get("mode"),
        difficulty=kwargs.get("difficulty"),
        obs_type="grayscale",
        frameskip=1,
        repeat_action_probability=sticky_action_probability(flags, kwargs),
        full_action_space=full_action_space(flags, kwargs),
        max_num_frames_per_episode=kwargs.get("max_num_frames_per_episode", MAX_FRAMES_PER_EPISODE),
        render_mode=render_mode,  # "rgb_array": the colour screen, whatever obs_type is
    )
    return AtariPreprocessing(atari, noop_max=noop_max(flags),
                              episodic_life=bool(flags.episodic_life))
