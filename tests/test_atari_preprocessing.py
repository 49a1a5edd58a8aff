"""The DeepMind-style Atari preprocessing that beast.envs.create_env puts on an ALE id, seen from
the emulator: the frame skip, the max-pooling of the last two screens, the no-op starts and
FIRE at reset.

The env comes from create_env(flags) and is watched through what Gymnasium and ale_py expose
(env.unwrapped is the AtariEnv, env.unwrapped.ale its emulator): the emulator's frame counters
count the raw frames, and a saved emulator state replayed with known actions gives the screens
and RAM the preprocessing must have seen. Sticky actions are off (repeat_action_probability 0),
so a replay of the same actions gives the same frames.
"""

import ale_py
import numpy as np
import pytest

import flag_helpers
from beast import envs

FRAME_SKIP = 4  # emulator frames per agent step (Mnih et al., 2015)
NOOP_MAX = 30  # a game starts after 1..NOOP_MAX random no-op frames
SCREEN_SIZE = 84


def make_env(env_id):
    flags = flag_helpers.make_flags(env=env_id, episodic_life=False,
                                    repeat_action_probability=0.0)
    return envs.create_env(flags)


def ale_actions(env):
    """The ALE action of each of the agent's actions."""
    return [ale_py.Action[name] for name in env.unwrapped.get_action_meanings()]


def area_resize(image, size=SCREEN_SIZE):
    """uint8 [H, W] -> float64 [size, size]: each output pixel the mean of the input over the
    rectangle it covers, input pixels partly covered weighted by the covered fraction."""
    def weights(n_in):  # [size, n_in]: the share of input pixel p in output pixel o
        edges = np.linspace(0, n_in, size + 1)
        low, high = edges[:-1, None], edges[1:, None]
        pixel = np.arange(n_in)[None, :]
        overlap = np.clip(np.minimum(high, pixel + 1) - np.maximum(low, pixel), 0, None)
        return overlap / (high - low)
    return weights(image.shape[0]) @ image.astype(np.float64) @ weights(image.shape[1]).T


def play(ale, actions):
    """Acts each ALE action for one frame; returns the grayscale screen after each."""
    screens = []
    for action in actions:
        ale.act(action)
        screens.append(ale.getScreenGrayscale())
    return screens


def test_a_step_plays_four_frames_and_max_pools_the_last_two_screens():
    """Each agent step advances the emulator by FRAME_SKIP frames, and the newest frame of the
    stack is the two last screens' pixelwise maximum, shrunk to 84x84. Replaying the step from
    the state before it gives those screens."""
    env = make_env("ALE/Pong-v5")
    ale, actions = env.unwrapped.ale, ale_actions(env)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    steps, pooling_shows = 50, 0
    for _ in range(steps):
        action = int(rng.integers(len(actions)))
        before, frame_number = ale.cloneState(), ale.getFrameNumber()
        observation, _, terminated, truncated, _ = env.step(action)
        assert not (terminated or truncated)  # a game of Pong lasts much longer
        frames = ale.getFrameNumber() - frame_number
        assert frames == FRAME_SKIP, f"a step played {frames} emulator frames"
        after = ale.cloneState()
        ale.restoreState(before)
        screens = play(ale, [actions[action]] * FRAME_SKIP)
        ale.restoreState(after)
        pooled = area_resize(np.maximum(screens[-2], screens[-1]))
        assert observation.shape == (4, SCREEN_SIZE, SCREEN_SIZE)
        # Within the rounding of a resize to uint8 (2 levels: OpenCV's INTER_AREA in fixed point).
        np.testing.assert_allclose(observation[-1], pooled, atol=2)
        # Where the ball or a paddle moved between the two screens, the last screen alone
        # differs from the pooled frame by far more than the rounding.
        pooling_shows += np.abs(pooled - area_resize(screens[-1])).max() > 10
    # 46 of these 50 steps show it; without the max-pool each of those would fail above.
    assert pooling_shows >= steps // 2


def reset_frames(env, resets):
    """The emulator frames each reset() played in the new game, for `resets` resets."""
    env.reset(seed=0)
    frames = []
    for _ in range(resets):
        env.reset()
        frames.append(env.unwrapped.ale.getEpisodeFrameNumber())
    return frames


@pytest.mark.parametrize("env_id, fire_frames", [("ALE/Freeway-v5", 0),
                                                 ("ALE/Breakout-v5", FRAME_SKIP)],
                         ids=["no-FIRE", "FIRE"])
def test_reset_plays_1_to_30_random_noops_and_then_fire_if_the_game_has_it(env_id, fire_frames):
    """A new game starts with 1..NOOP_MAX no-op frames drawn at random, then (in a game with a
    FIRE action) one agent step of FIRE: the new game's frame count is the two together."""
    env = make_env(env_id)
    assert ("FIRE" in env.unwrapped.get_action_meanings()) == bool(fire_frames)
    noops = [frames - fire_frames for frames in reset_frames(env, 100)]
    assert min(noops) >= 1 and max(noops) <= NOOP_MAX, sorted(noops)
    # Drawn at random over the whole range: 100 uniform draws from 1..30 miss neither end by
    # more than 3, and take more than 20 of the 30 values, but for odds under 1e-4.
    assert min(noops) <= 3 and max(noops) >= NOOP_MAX - 2, sorted(noops)
    assert len(set(noops)) > 20, sorted(noops)
    env.close()


@pytest.mark.parametrize("env_id", ["ALE/Freeway-v5", "ALE/Breakout-v5"])
def test_reset_leaves_the_emulator_where_noops_then_fire_take_it(env_id):
    """After reset(seed), the emulator's RAM and screen are those of the AtariEnv's own reset
    with the same seed followed by the no-ops and (where the game has it) FIRE: in Breakout,
    FIRE launches the ball, so no-ops alone for as many frames leave another RAM."""
    env = make_env(env_id)
    ale = env.unwrapped.ale
    has_fire = "FIRE" in env.unwrapped.get_action_meanings()
    fire_frames = FRAME_SKIP if has_fire else 0
    noop, fire = ale_py.Action.NOOP, ale_py.Action.FIRE
    for seed in range(3):
        env.reset(seed=seed)
        frames = ale.getEpisodeFrameNumber()
        ram, screen = ale.getRAM().copy(), ale.getScreenGrayscale()

        env.unwrapped.reset(seed=seed)
        assert ale.getEpisodeFrameNumber() == 0
        play(ale, [noop] * (frames - fire_frames) + [fire] * fire_frames)
        np.testing.assert_array_equal(ale.getRAM(), ram)
        np.testing.assert_array_equal(ale.getScreenGrayscale(), screen)

        if has_fire:
            env.unwrapped.reset(seed=seed)
            play(ale, [noop] * frames)
            assert not np.array_equal(ale.getRAM(), ram), "FIRE made no difference to check"
    env.close()


@pytest.mark.parametrize("noop_max", [0, 5])
def test_noop_max_bounds_the_no_op_start(noop_max):
    """--noop_max 0 (the Machado et al. protocol) starts every game at once: Freeway's new games
    have played no frame; --noop_max 5 starts them after 1..5."""
    flags = flag_helpers.make_flags(env="ALE/Freeway-v5", episodic_life=False,
                                    repeat_action_probability=0.0, noop_max=noop_max)
    env = envs.create_env(flags)
    noops = set(reset_frames(env, 40))
    env.close()
    assert noops == ({0} if noop_max == 0 else set(range(1, noop_max + 1))), sorted(noops)


@pytest.mark.parametrize("backend", ["gymnasium", "envpool"])
def test_full_action_space_gives_all_18_actions(backend):
    if backend == "envpool":
        pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    flags = flag_helpers.make_flags(env="ALE/Pong-v5", env_backend=backend)
    assert envs.env_info(flags)["num_actions"] == 6  # Pong's minimal set, the id's own
    flags.full_action_space = True
    assert envs.env_info(flags)["num_actions"] == 18


@pytest.mark.parametrize("flag, value", [("noop_max", 0), ("full_action_space", True),
                                         ("repeat_action_probability", 0.25),
                                         ("episodic_life", True)])
def test_atari_flags_are_refused_for_other_environments(flag, value):
    with pytest.raises(ValueError, match=f"--{flag} is for atari environments only"):
        envs.create_env(flag_helpers.make_flags(env="CartPole-v1", **{flag: value}))


@pytest.mark.parametrize("flag", ["episodic_life", "full_action_space"])
def test_an_atari_switch_turned_off_is_what_other_environments_do_and_is_taken(flag):
    envs.create_env(flag_helpers.make_flags(env="CartPole-v1", **{flag: False})).close()


@pytest.mark.parametrize("game", ["Pong", "Breakout"])
def test_frames_rewards_and_ends_are_envpools_given_its_emulator_calls(game):
    """EnvPool, the env of Cleanba's IMPALA, is an independent implementation of the same
    preprocessing. Ours differs from it only in which emulator frames it plays at a reset and at
    a game's end (bench/envpool_frames.py's EnvPoolSequence copies EnvPool's there), so with
    those calls copied every stack, RAM, clipped reward and done flag must match over random
    play of all 18 actions, games ending included."""
    pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    from bench import envpool_frames

    actions = np.random.default_rng(0).integers(envpool_frames.NUM_ACTIONS, size=600)
    ours = envpool_frames.EnvPoolSequence(envpool_frames.make_ours(game, 0.0).unwrapped,
                                          noop_max=0)
    rows = envpool_frames.lockstep(ours, envpool_frames.make_envpool(game, 0.0, 0), actions,
                                   0, game)
    kinds = {row["kind"] for row in rows}
    assert "last" in kinds or game == "Pong", "no game ended: nothing checked at a game's end"
    for key in ("stack_equal", "ram_equal", "rewards_equal", "raw_rewards_equal", "done_equal"):
        differ = [row["index"] for row in rows if not row[key]]
        assert not differ, f"{key}: {len(differ)} of {len(rows)} steps differ, first {differ[:5]}"
