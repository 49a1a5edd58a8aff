"""beast.vector_envs: N environments stepped together in RolloutAdapter's convention, for both
backends, and MonoBeast's Sampler on top of it."""

import argparse

import numpy as np
import pytest

from beast import envpool_backend, envs, rollout, vector_envs


def make_flags(env, **overrides):
    flags = dict(env=env, env_backend="gymnasium", episodic_life=False,
                 repeat_action_probability=None, full_action_space=None, noop_max=None,
                 penalty_step=None, seed=0)
    flags.update(overrides)
    return argparse.Namespace(**flags)


def assert_same_step(batch, row, single):
    for key, value in single.items():
        np.testing.assert_array_equal(batch[key][row], value, err_msg=key)


def test_gymnasium_backend_equals_separate_adapters():
    flags = make_flags("CartPole-v1")
    vector = vector_envs.create_vector_env(flags, 3, seed=11)
    singles = [envs.RolloutAdapter(envs.create_env(flags), seed=vector_envs.env_seed(11, j))
               for j in range(3)]
    try:
        out = vector.initial()
        assert out["frame"].shape == (3, 4) and out["done"].all()
        for j, single in enumerate(singles):
            assert_same_step(out, j, single.initial())
        rng = np.random.default_rng(0)
        dones = 0
        for _ in range(300):
            actions = rng.integers(0, 2, 3)
            out = vector.step(actions)
            for j, single in enumerate(singles):
                assert_same_step(out, j, single.step(actions[j]))
            dones += int(out["done"].sum())
        assert dones > 10  # the comparison went through episode ends
        assert {key: out[key].dtype for key in out} == {
            f.name: f.dtype for f in rollout.core_env_fields((4,), np.float32)}
    finally:
        vector.close()
        for single in singles:
            single.close()


def test_gymnasium_backend_restarts_a_failing_environment(capfd):
    errors = []

    def on_error():
        errors.append(1)
        return len(errors)

    vector = vector_envs.create_vector_env(make_flags("tests.flaky_env:FlakyCartPole-v0"), 2,
                                           seed=3, on_error=on_error)
    try:
        vector.initial()
        for step in range(1, 1000):
            out = vector.step(np.ones(2, np.int64))
            if step % 500 == 0:  # both environments raise on their 500th step
                assert out["done"].all() and (out["episode_step"] == 0).all()
        assert len(errors) == 2
    finally:
        vector.close()
    assert "environment 0 raised in step; restarting it" in capfd.readouterr().err


def test_wrong_number_of_actions_and_bad_arguments():
    vector = vector_envs.create_vector_env(make_flags("CartPole-v1"), 2, seed=0)
    try:
        vector.initial()
        with pytest.raises(ValueError, match="expected 2 actions"):
            vector.step(np.zeros(3, np.int64))
    finally:
        vector.close()
    with pytest.raises(ValueError, match="at least one environment"):
        vector_envs.create_vector_env(make_flags("CartPole-v1"), 0, seed=0)
    with pytest.raises(ValueError, match="--env_backend"):
        vector_envs.create_vector_env(make_flags("CartPole-v1", env_backend="nope"), 1, seed=0)


@pytest.mark.slow
def test_envpool_backend_follows_our_episode_convention():
    """Row 0 of an EnvPool VectorEnv against RolloutAdapter(EnvPoolSingle), an independent path
    through the same emulator (EnvPool seeds environment 0 of a pool alike), over thousands of
    steps of Breakout with end-of-life episodes: lost lives, games over, resets."""
    pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    flags = make_flags("ALE/Breakout-v5", env_backend="envpool", episodic_life=True)
    vector = vector_envs.create_vector_env(flags, 2, seed=7)
    single = envs.RolloutAdapter(
        envpool_backend.EnvPoolSingle(envpool_backend.create_envpool(flags, 1, seed=7)))
    try:
        out = vector.initial()
        assert out["frame"].shape == (2, 4, 84, 84) and out["frame"].dtype == np.uint8
        assert_same_step(out, 0, single.initial())
        rng = np.random.default_rng(0)
        dones = games = 0
        for _ in range(3000):
            actions = rng.integers(0, 4, 2)
            out = vector.step(actions)
            assert_same_step(out, 0, single.step(actions[0]))
            dones += int(out["done"][0])
            games += int(out["game_over"][0])
        assert games >= 5 and dones >= 4 * games  # five lives per game
    finally:
        vector.close()
        single.close()
