"""Tests of beast/envs.py: create_env, the Atari preprocessing, and RolloutAdapter's rollout
format."""

import os
import subprocess
import sys

import ale_py
import gymnasium
import numpy as np
import pytest

import flag_helpers
from beast import atari_wrappers, envs, rollout, vector_envs
from bench import null_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_flags(env, **kwargs):
    kwargs.setdefault("episodic_life", False)
    return flag_helpers.make_flags(env=env, **kwargs)


def make_adapter(env, seed=0, **kwargs):
    return envs.RolloutAdapter(envs.create_env(make_flags(env, **kwargs)), seed=seed)


def random_steps(adapter, num_steps, seed=0):
    """Yields (action, output) for num_steps uniformly random actions."""
    rng = np.random.default_rng(seed)
    for _ in range(num_steps):
        action = int(rng.integers(adapter.num_actions))
        yield action, adapter.step(action)


ROLLOUT_TYPES = dict(
    reward=np.float32, done=np.bool_, truncated=np.bool_, game_over=np.bool_,
    episode_return=np.float32, episode_step=np.int32, last_action=np.int64,
)


def check_types(output):
    assert set(output) == {"frame", *ROLLOUT_TYPES}
    for key, dtype in ROLLOUT_TYPES.items():
        assert isinstance(output[key], dtype), (key, type(output[key]))


# ---------------------------------------------------------------------------------------------
# Atari.


def test_atari_frames_and_stack_order():
    adapter = make_adapter("ALE/Pong-v5", seed=1)
    assert adapter.observation_shape == (4, 84, 84)
    assert adapter.num_actions == 6
    first = adapter.initial()
    check_types(first)
    assert first["frame"].dtype == np.uint8 and first["frame"].shape == (4, 84, 84)
    assert first["done"] and not first["game_over"]
    assert first["reward"] == 0 and first["episode_return"] == 0 and first["episode_step"] == 0
    assert first["last_action"] == 0
    # A new game fills the stack with its first frame.
    assert all(np.array_equal(first["frame"][0], first["frame"][k]) for k in range(1, 4))

    # Frame skip, max-pooling, no-op starts and FIRE: tests/test_atari_preprocessing.py.
    previous = first["frame"]
    changed = 0
    for action, output in random_steps(adapter, 60):
        check_types(output)
        frame = output["frame"]
        assert frame is not previous  # fresh arrays: the caller may keep them
        assert output["last_action"] == action
        assert not output["done"]
        # Older frames move down by one; the newest is last.
        np.testing.assert_array_equal(frame[:-1], previous[1:])
        changed += not np.array_equal(frame[-1], frame[-2])
        previous = frame
    assert changed > 0
    adapter.close()
    adapter.close()  # a second close does nothing


def test_atari_rewards_add_up_to_episode_return():
    adapter = make_adapter("ALE/Pong-v5", seed=2)
    adapter.initial()
    total, steps, nonzero = 0.0, 0, 0
    for _, output in random_steps(adapter, 400, seed=2):
        total += output["reward"]
        steps += 1
        nonzero += output["reward"] != 0
        assert output["reward"] in (-1.0, 0.0, 1.0)
        assert output["episode_return"] == total
        assert output["episode_step"] == steps
        if output["game_over"]:
            total, steps = 0.0, 0
    assert nonzero > 0  # Pong scores within 400 steps of random play
    adapter.close()


def test_old_atari_id_plays_a_full_game_and_resets():
    info = envs.env_info(make_flags("PongNoFrameskip-v4"))
    fields = info.pop("env_fields")
    assert info == dict(observation_shape=(4, 84, 84), observation_dtype=np.dtype(np.uint8),
                        num_actions=6, continuous=False, action_low=None, action_high=None,
                        kind="atari")
    assert fields == rollout.core_env_fields((4, 84, 84), np.uint8)
    adapter = make_adapter("PongNoFrameskip-v4", seed=3)
    ale = adapter.env.unwrapped.ale
    assert ale.getFloat("repeat_action_probability") == 0.0  # v4: no sticky actions
    adapter.initial()
    total, steps = 0.0, 0
    for _, output in random_steps(adapter, 5000, seed=3):
        total += output["reward"]
        steps += 1
        assert output["game_over"] == output["done"]
        if output["done"]:
            break
    else:
        pytest.fail("a random Pong game should end within 5000 steps")
    assert output["episode_return"] == total and output["episode_step"] == steps
    assert -21 <= total < 0  # the random player loses; the game ends at 21 points
    # The frame after game over is the new game's first: a stack of one repeated frame.
    frame = output["frame"]
    assert all(np.array_equal(frame[0], frame[k]) for k in range(1, 4))
    assert ale.getEpisodeFrameNumber() < 200  # a fresh game: only the no-ops and FIRE so far
    output = adapter.step(0)
    assert output["episode_step"] == 1 and output["episode_return"] == output["reward"]
    adapter.close()


def test_v5_keeps_sticky_actions():
    env = envs.create_env(make_flags("ALE/Pong-v5"))
    assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
    env.close()
    env = envs.create_env(make_flags("ALE/Pong-v5", repeat_action_probability=0.0))
    assert env.unwrapped.ale.getFloat("repeat_action_probability") == 0.0
    env.close()


def test_episodic_life_ends_training_episodes_at_life_loss():
    adapter = make_adapter("ALE/Breakout-v5", seed=4, episodic_life=True)
    ale = adapter.env.unwrapped.ale
    adapter.initial()
    assert ale.lives() == 5
    total, steps, life_losses = 0.0, 0, 0
    for _, output in random_steps(adapter, 5000, seed=4):
        total += output["reward"]
        steps += 1
        # The return and length are the real game's: they go on across lives.
        assert output["episode_return"] == total and output["episode_step"] == steps
        if output["game_over"]:
            assert output["done"]
            break
        if output["done"]:
            life_losses += 1
            # The emulator was not reset: the game goes on with one life fewer.
            assert ale.lives() == 5 - life_losses
    else:
        pytest.fail("a random Breakout game should end within 5000 steps")
    assert life_losses == 4
    assert ale.lives() == 5  # a new game after game over
    output = adapter.step(0)
    assert output["episode_step"] == 1 and not output["done"]
    adapter.close()


def test_without_episodic_life_done_only_at_game_over():
    adapter = make_adapter("ALE/Breakout-v5", seed=4)
    ale = adapter.env.unwrapped.ale
    adapter.initial()
    lives_seen = {ale.lives()}
    for _, output in random_steps(adapter, 5000, seed=4):
        assert output["done"] == output["game_over"]
        if output["done"]:
            break
        lives_seen.add(ale.lives())
    else:
        pytest.fail("a random Breakout game should end within 5000 steps")
    assert lives_seen == {1, 2, 3, 4, 5}
    adapter.close()


def test_area_resize_matches_block_means():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (210, 160)).astype(np.uint8)
    # Slow reference from the definition: upsample to a common multiple, then average blocks.
    # 210 rows * 2 = 84 * 5; 160 columns * 21 = 84 * 40.
    upsampled = np.repeat(np.repeat(image.astype(np.float64), 2, axis=0), 21, axis=1)
    expected = upsampled.reshape(84, 5, 84, 40).mean(axis=(1, 3))
    # resize_screen rounds to uint8: within half a level of the exact mean.
    np.testing.assert_allclose(atari_wrappers.resize_screen(image, 84), expected, atol=0.5 + 1e-3)
    small = rng.integers(0, 256, (8, 8)).astype(np.uint8)
    np.testing.assert_allclose(atari_wrappers.resize_screen(small, 4),
                               small.reshape(4, 2, 4, 2).mean(axis=(1, 3)), atol=0.5)


# ---------------------------------------------------------------------------------------------
# Other environments.


def test_cartpole_matches_gymnasium():
    adapter = make_adapter("CartPole-v1", seed=5)
    reference = gymnasium.make("CartPole-v1")
    first = adapter.initial()
    check_types(first)
    expected, _ = reference.reset(seed=5)
    assert first["frame"].dtype == np.float32 and first["frame"].shape == (4,)
    np.testing.assert_array_equal(first["frame"], expected)
    assert first["done"] and not first["game_over"] and first["episode_step"] == 0

    for episode in range(2):
        for step in range(1, 501):
            output = adapter.step(1)  # always push right: the pole falls within a few dozen steps
            expected, reward, terminated, truncated, _ = reference.step(1)
            assert output["reward"] == reward == 1.0
            assert output["episode_step"] == step and output["episode_return"] == step
            assert output["done"] == output["game_over"] == (terminated or truncated)
            if output["done"]:
                break
            np.testing.assert_array_equal(output["frame"], expected)
        assert terminated and step < 100
        # After the end, the frame is the next episode's first observation.
        expected, _ = reference.reset()
        np.testing.assert_array_equal(output["frame"], expected)
    adapter.close()


def test_null_env_episodes_last_100_steps():
    adapter = make_adapter(null_env.ENV_ID)
    assert adapter.observation_shape == (4,) and adapter.num_actions == 2
    first = adapter.initial()
    assert first["frame"].dtype == np.float32
    done_at = [step for step in range(1, 301) if adapter.step(step % 2)["done"]]
    assert done_at == [100, 200, 300]
    adapter.close()
    assert envs.env_info(make_flags(null_env.ATARI_ENV_ID))["observation_shape"] == (4, 84, 84)


def test_discrete_observations_become_one_hot():
    adapter = make_adapter("FrozenLake-v1")
    assert adapter.observation_shape == (16,)
    frame = adapter.initial()["frame"]
    assert frame.dtype == np.float32 and frame.sum() == 1.0 and frame[0] == 1.0  # starts top-left
    frame[:] = 0  # frames are the caller's to keep or change: this must not reach the next one
    assert adapter.initial()["frame"][0] == 1.0
    adapter.close()


class Discrete:
    """Stands in for old gym's Discrete space (create_env converts by class name)."""

    def __init__(self, n):
        self.n = n


class Box:
    """Stands in for old gym's Box space."""

    def __init__(self, low, high, shape, dtype):
        self.low, self.high, self.shape, self.dtype = low, high, shape, np.dtype(dtype)


class OldCounterEnv:
    """An env with the old gym API: reset() -> obs; step() -> (obs, reward, done, info)."""

    def __init__(self, episode_length=5):
        self.observation_space = Box(0.0, 100.0, (1,), np.float64)
        self.action_space = Discrete(3)
        self.episode_length = episode_length
        self.seeded_with = None
        self.count = 0

    def seed(self, seed):
        self.seeded_with = seed

    def reset(self):
        self.count = 0
        return np.zeros(1)

    def step(self, action):
        self.count += 1
        return np.full(1, float(self.count)), 1.0, self.count >= self.episode_length, {}


class OldApiGymnasiumEnv(OldCounterEnv, gymnasium.Env):
    """Subclasses gymnasium.Env but keeps the old reset/step."""

    def __init__(self, episode_length=5):
        super().__init__(episode_length)
        self.observation_space = gymnasium.spaces.Box(0.0, 100.0, (1,), np.float64)
        self.action_space = gymnasium.spaces.Discrete(3)


def test_legacy_gym_api_adapter():
    env = envs.LegacyGymAPI(OldCounterEnv())
    assert isinstance(env.action_space, gymnasium.spaces.Discrete) and env.action_space.n == 3
    assert isinstance(env.observation_space, gymnasium.spaces.Box)
    obs, info = env.reset(seed=7)
    assert env.env.seeded_with == 7 and info == {} and obs.shape == (1,)
    results = [env.step(0) for _ in range(5)]
    assert all(len(result) == 5 for result in results)
    assert [result[2] for result in results] == [False] * 4 + [True]  # terminated
    assert not any(result[3] for result in results)  # truncated

    class TimeLimited(OldCounterEnv):
        def step(self, action):
            obs, reward, done, info = super().step(action)
            return obs, reward, done, {"TimeLimit.truncated": done}

    env = envs.LegacyGymAPI(TimeLimited(episode_length=2))
    env.reset()
    env.step(0)
    _, _, terminated, truncated, _ = env.step(0)
    assert truncated and not terminated


@pytest.mark.parametrize("env_class", [OldCounterEnv, OldApiGymnasiumEnv])
def test_create_env_detects_old_api(env_class):
    env_id = f"BeastTest{env_class.__name__}-v0"
    gymnasium.register(env_id, entry_point=env_class, max_episode_steps=3,
                       kwargs=dict(episode_length=10))
    try:
        adapter = make_adapter(env_id)
        assert adapter.initial()["frame"].dtype == np.float32  # float64 vectors are cast
        outputs = [adapter.step(1) for _ in range(5)]
        # The TimeLimit cuts the third step: its final observation comes with truncated, the
        # next step starts the next episode (done) whatever its action.
        truncated = [bool(output["truncated"]) for output in outputs]
        assert truncated == [False, False, True, False, False]
        assert [bool(output["done"]) for output in outputs] == [False, False, False, True, False]
        assert outputs[2]["episode_return"] == 3.0 and outputs[2]["episode_step"] == 3
        assert outputs[2]["game_over"] and not outputs[3]["game_over"]
        np.testing.assert_array_equal(outputs[2]["frame"], [3.0])
        np.testing.assert_array_equal(outputs[4]["frame"], [1.0])
        adapter.close()
    finally:
        del gymnasium.registry[env_id]


# ---------------------------------------------------------------------------------------------
# Errors, determinism, env_info.


def test_unknown_id_names_the_packages():
    with pytest.raises(ValueError) as error:
        envs.create_env(make_flags("CartPol-v1"))
    message = str(error.value)
    for expected in ("CartPole-v1", "ALE/<Game>-v5", "NoFrameskip-v4", "pip install ale-py",
                     "gymnasium", "pip install minatar", "Null-v0"):
        assert expected in message
    with pytest.raises(ValueError, match="ALE/Pong-v5"):
        envs.create_env(make_flags("ALE/Pongg-v5"))


def test_missing_optional_packages_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "minatar", None)  # makes `import minatar` fail
    monkeypatch.setitem(sys.modules, "minatar.gym", None)
    with pytest.raises(ValueError, match="pip install minatar"):
        envs.create_env(make_flags("MinAtar/Breakout-v1"))
    monkeypatch.setitem(sys.modules, "envpool", None)
    with pytest.raises(ValueError, match="pip install envpool"):
        envs.create_env(make_flags("ALE/Pong-v5", env_backend="envpool"))


def test_env_info():
    info = envs.env_info(make_flags("CartPole-v1"))
    assert info.pop("env_fields") == rollout.core_env_fields((4,), np.float32)
    assert info == dict(observation_shape=(4,), observation_dtype=np.dtype(np.float32),
                        num_actions=2, continuous=False, action_low=None, action_high=None,
                        kind="vector")
    # Box action spaces are tests/test_continuous.py's; others are refused.
    env = gymnasium.make("CartPole-v1")
    env.action_space = gymnasium.spaces.MultiDiscrete([2, 3])
    with pytest.raises(ValueError, match="Discrete"):
        envs.RolloutAdapter(env)


def trajectory(env_id, seed, num_steps):
    """Frames and rewards of num_steps actions drawn from the adapter's own seeded action space."""
    adapter = make_adapter(env_id, seed=seed)
    frames = [adapter.initial()["frame"]]
    rewards = []
    for _ in range(num_steps):
        output = adapter.step(adapter.env.action_space.sample())
        frames.append(output["frame"])
        rewards.append(output["reward"])
    adapter.close()
    return np.stack(frames), np.array(rewards)


@pytest.mark.parametrize("env_id", ["ALE/Pong-v5", "CartPole-v1"])
def test_same_seed_same_trajectory(env_id):
    frames, rewards = trajectory(env_id, seed=11, num_steps=150)
    frames_again, rewards_again = trajectory(env_id, seed=11, num_steps=150)
    np.testing.assert_array_equal(frames, frames_again)
    np.testing.assert_array_equal(rewards, rewards_again)
    other_frames, _ = trajectory(env_id, seed=12, num_steps=150)
    assert not np.array_equal(frames, other_frames)


# ---------------------------------------------------------------------------------------------
# Optional packages: run only where they are installed.


@pytest.mark.slow
def test_minatar_channels_first():
    pytest.importorskip("minatar", reason="MinAtar is optional: pip install minatar")
    info = envs.env_info(make_flags("MinAtar/Breakout-v1"))
    assert info["observation_shape"][1:] == (10, 10) and info["kind"] == "image"
    adapter = make_adapter("MinAtar/Breakout-v1")
    first = adapter.initial()
    assert first["frame"].dtype == np.float32 and first["frame"].shape == info["observation_shape"]
    for _, output in random_steps(adapter, 50):
        assert output["frame"].flags.c_contiguous
    adapter.close()


def test_envpool_backend_episodic_life():
    pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    adapter = make_adapter("ALE/Breakout-v5", seed=4, episodic_life=True, env_backend="envpool")
    assert adapter.initial()["frame"].shape == (4, 84, 84)
    total, steps, life_losses = 0.0, 0, 0
    for _, output in random_steps(adapter, 5000, seed=4):
        total += output["reward"]
        steps += 1
        assert output["episode_return"] == total and output["episode_step"] == steps
        if output["game_over"]:
            break
        life_losses += bool(output["done"])
    else:
        pytest.fail("a random Breakout game should end within 5000 steps")
    assert life_losses == 4
    adapter.close()


# ---------------------------------------------------------------------------------------------
# Wrappers: the one place to add them, and the traps they used to fall into.


class DoubleReward(gymnasium.RewardWrapper):
    def reward(self, reward):
        return 2.0 * reward


def test_wrappers_reach_every_environment(monkeypatch):
    """A wrapper listed in WRAPPERS wraps what create_env makes, hence the adapters and the
    vector envs that MonoBeast's actors, PolyBeast's servers and evaluation use."""
    monkeypatch.setattr(envs, "WRAPPERS", (DoubleReward,))
    flags = make_flags("CartPole-v1")
    assert isinstance(envs.create_env(flags), DoubleReward)
    adapter = envs.RolloutAdapter(envs.create_env(flags), seed=0)
    adapter.initial()
    assert adapter.step(0)["reward"] == 2.0
    vector = vector_envs.create_vector_env(flags, 2, seed=0)
    vector.initial()
    assert (vector.step(np.zeros(2, np.int64))["reward"] == 2.0).all()
    vector.close()


def test_envpool_refuses_wrappers_by_name(monkeypatch):
    pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    monkeypatch.setattr(envs, "WRAPPERS", (DoubleReward,))
    flags = make_flags("ALE/Pong-v5")
    flags.env_backend = "envpool"
    with pytest.raises(ValueError, match="DoubleReward"):
        envs.create_env(flags)
    with pytest.raises(ValueError, match="DoubleReward"):
        vector_envs.create_vector_env(flags, 2, seed=0)


def test_atari_is_recognised_whatever_wraps_it(monkeypatch):
    """Pong in a wrapper keeps the Atari defaults, not the small-image ones."""
    monkeypatch.setattr(envs, "WRAPPERS", (gymnasium.wrappers.RecordEpisodeStatistics,))
    assert envs.env_info(make_flags("ALE/Pong-v5"))["kind"] == "sticky_atari"
    assert envs.env_info(make_flags("PongNoFrameskip-v4"))["kind"] == "atari"
    assert envs.env_info(make_flags("CartPole-v1"))["kind"] == "vector"


@pytest.mark.parametrize("backend", ["gymnasium", "envpool"])
@pytest.mark.parametrize("env_id, probability, kind", [
    ("ALE/Pong-v5", None, "sticky_atari"), ("ALE/Pong-v5", 0.0, "atari"),
    ("PongNoFrameskip-v4", None, "atari"), ("PongNoFrameskip-v4", 0.25, "sticky_atari")])
def test_the_emulators_sticky_actions_pick_the_kind(backend, env_id, probability, kind):
    """The kind follows the probability the emulator runs with, the id's own (v5: 0.25, v4:
    0) or --repeat_action_probability's, on either backend: the defaults follow the
    protocol, not the id's spelling."""
    if backend == "envpool":
        pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    flags = make_flags(env_id, repeat_action_probability=probability, env_backend=backend)
    env = envs.create_env(flags)
    try:
        assert envs.env_kind(env) == kind
    finally:
        env.close()


def test_a_wrapper_inside_the_atari_preprocessing_is_refused():
    """The preprocessing drives ALE directly: a wrapper between it and ALE would never run."""
    atari = ale_py.AtariEnv(game="pong", frameskip=1)
    with pytest.raises(TypeError, match="never run"):
        atari_wrappers.AtariPreprocessing(gymnasium.wrappers.RecordEpisodeStatistics(atari))
    atari.close()


@pytest.mark.parametrize("env_id, filled", [
    ("ALE/Pong-v5", dict(full_action_space=False, noop_max=30, penalty_step=None)),
    ("NetHackStaircase-v0", dict(full_action_space=None, noop_max=None, penalty_step=-0.00001)),
    ("NetHackChallenge-v0", dict(full_action_space=None, noop_max=None, penalty_step=0.0)),
    ("CartPole-v1", dict(full_action_space=None, noop_max=None, penalty_step=None))])
def test_the_family_flags_of_the_env_are_filled_with_what_its_environments_take(env_id, filled):
    if env_id.startswith("NetHack"):
        pytest.importorskip("nle", reason="NetHack is optional: pip install --no-deps nle")
    flags = envs.fill_family_flags(flag_helpers.make_flags(env=env_id))
    assert {name: getattr(flags, name) for name in filled} == filled


def test_envpool_refuses_the_flags_of_other_families():
    with pytest.raises(ValueError, match="--penalty_step is for nethack environments only"):
        envs.check_backend(flag_helpers.make_flags(env="ALE/Pong-v5", env_backend="envpool",
                                                   penalty_step=-0.1))


@pytest.mark.timeout(120)
def test_envpool_starts_games_without_no_ops_at_noop_max_0():
    """EnvPool draws its no-ops from 0..noop_max-1, an empty range at 0: it gets 1, none. Without
    no-ops and sticky actions every Breakout game starts on the same screen; with them, not."""
    pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")

    def first_screens(noop_max):
        screens = []
        for seed in (1, 2, 3, 4):
            flags = flag_helpers.make_flags(env="ALE/Breakout-v5", env_backend="envpool",
                                            noop_max=noop_max, repeat_action_probability=0.0,
                                            seed=seed)
            env = envs.create_env(flags)
            screens.append(env.reset(seed=seed)[0])
            env.close()
        return [np.array_equal(screens[0], other) for other in screens[1:]]

    assert all(first_screens(0))
    assert not all(first_screens(30))


def test_a_cartpole_run_loads_no_package_of_the_other_families(tmp_path):
    """The Atari, EnvPool, MinAtar and NetHack modules (and ale_py, cv2, envpool, minatar,
    nle) load only for their own environments."""
    heavy = ["ale_py", "cv2", "envpool", "minatar", "nle", "beast.atari_wrappers",
             "beast.envpool_backend", "beast.minatar_env", "beast.nethack_env"]
    code = ("import sys, monobeast; "
            f"rc = monobeast.main(['--savedir', {str(tmp_path)!r}, '--env', 'CartPole-v1', "
            "'--num_actors', '1', '--total_steps', '1280', '--no_progress']); "
            f"loaded = [m for m in {heavy!r} if m in sys.modules]; "
            "assert rc == 0, rc; print('loaded:', loaded)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "loaded: []" in result.stdout, result.stdout
