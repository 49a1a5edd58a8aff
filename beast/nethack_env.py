"""NetHack, the NetHack Learning Environment's games (the nle package), as create_env makes them.

    action (int: one of a task's 23 keys, or of the full keyboard) -> NetHackEnv.step -> NLE
        -> dict(glyphs [21, 79] int16, blstats [27] int64), fresh arrays

beast/envs.py `create_env` calls `make_nethack` for the ids in envs.NETHACK_IDS. NLE builds
only the entries that --model nethack reads (NETHACK_KEYS), and every game follows the first
reset's seed (NetHackEnv).

Only numpy, gymnasium and nle (on first use) are imported.
"""

import gymnasium
import numpy as np

# The entries of NLE's observation that NetHack environments return: what --model nethack
# reads (beast/models.py NetHackNet). NLE builds only these; its other entries cost a copy
# per step each (screen_descriptions alone is 21 x 79 x 80 bytes).
NETHACK_KEYS = ("glyphs", "blstats")
# NLE's penalty for a step on which the game's clock stands still (a menu, a prompt, a move into
# a wall), unless --penalty_step says otherwise: the NLE paper's released configuration, -0.001
# a still step beside a success worth 100. NLE now pays 1 for a success, so the tasks that end
# there keep the paper's ratio at -0.001 / 100; the others are paid in score, gold, food or
# squares seen, as in the paper. NLE registers -0.01 (0 for Challenge): on Staircase random
# actions spend about 1,100 still steps a game, so any penalty near that size pays a policy
# more to die at once than to search (docs/results.md#nethack). NetHack-v0 takes none.
# NetHackChallenge-v0 keeps NLE's 0: the challenge's own rules, scored by the game alone.
NETHACK_PENALTY_STEP = -0.001
SUCCESS_TASKS = ("NetHackStaircase-v0", "NetHackStaircasePet-v0", "NetHackOracle-v0")
SUCCESS_PENALTY_STEP = NETHACK_PENALTY_STEP / 100


def default_penalty_step(env_id):
    """The penalty a still step of env_id costs unless --penalty_step is given; None for
    NetHack-v0, which takes none."""
    if env_id == "NetHack-v0":
        return None
    if env_id == "NetHackChallenge-v0":
        return 0.0
    return SUCCESS_PENALTY_STEP if env_id in SUCCESS_TASKS else NETHACK_PENALTY_STEP


def registered_penalty_step(env_id):
    """NLE's own penalty for env_id (-0.01; 0 for Challenge), what runs saved before
    --penalty_step trained with; None for NetHack-v0 and for ids that are not NetHack's."""
    env_id = env_id.split(":")[-1]
    if not env_id.startswith("NetHack") or env_id == "NetHack-v0":
        return None
    return 0.0 if env_id == "NetHackChallenge-v0" else -0.01


def make_nethack(env_id, penalty_step=None, **make_kwargs):
    """NetHackEnv over gymnasium.make(env_id) of an NLE id; make_kwargs (render_mode) go to
    gymnasium.make. Raises ValueError without nle, or for a penalty NetHack-v0 cannot take."""
    try:
        import nle  # noqa: F401 (importing it registers the NetHack ids)
    except ImportError as error:
        raise ValueError(f"Environment {env_id!r} needs the NetHack Learning Environment: "
                         "pip install --no-deps nle (as scripts/setup.sh does: nle pins an "
                         "older gymnasium, and runs on the one installed)") from error
    task = {}
    if env_id != "NetHack-v0":
        task["penalty_step"] = penalty_step if penalty_step is not None else (
            default_penalty_step(env_id))
    elif penalty_step is not None:
        raise ValueError("--penalty_step: NetHack-v0 is NLE's base game, rewarded by its score "
                         "with no penalty; leave it out, or use NetHackScore-v0")
    # fix_moon_phase: the moon's phase and Friday the 13th, which change the game's luck,
    # follow the seed instead of the date, so that a seeded game is the same on any day.
    return NetHackEnv(gymnasium.make(env_id, observation_keys=NETHACK_KEYS,
                                       fix_moon_phase=True, disable_env_checker=True,
                                       **task, **make_kwargs))


class NetHackEnv(gymnasium.Wrapper):
    """What an NLE environment needs to keep the promises of create_env's environments.

    Fresh arrays: NLE writes every step's observation into the same arrays, which a caller
    may still hold; each step's are copied (a few kB).
    Seeds: Gymnasium's reset(seed=...) does not reach NetHack's own random generators. The
    first reset's seed starts a generator that draws the seeds (core and disp) of every game
    after it, NetHack's reseeding from true randomness turned off, so that a seeded
    environment plays the same games again; without a seed, NLE draws its own.
    """

    env_kind = "nethack"  # beast/envs.py env_kind: the kind whose defaults a run takes

    def __init__(self, env):
        super().__init__(env)
        self._game_seeds = None

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self._game_seeds = np.random.default_rng(seed)
        if self._game_seeds is not None:
            core, disp = (int(s) for s in self._game_seeds.integers(2**63 - 1, size=2))
            self.env.unwrapped.seed(core, disp, reseed=False)
        observation, info = self.env.reset(seed=seed, options=options)
        return _copied(observation), info

    def step(self, action):
        observation, *rest = self.env.step(action)
        return (_copied(observation), *rest)


def _copied(observation):
    return {key: value.copy() for key, value in observation.items()}
