"""NetHack (the NetHack Learning Environment, which scripts/setup.sh installs): the environment
kind, its model (beast/models.py NetHackNet) and both variants on it, one across two hosts.

Every test here needs the nle package and is skipped, saying so, without it.
"""

import json
import math
import os
import socket
import subprocess
import sys

import gymnasium
import numpy as np
import pytest
import torch

import flag_helpers
import monobeast
from beast import distributed, envs, models, nethack_env, runlog
from bench import netns

nle = pytest.importorskip("nle", reason="the NetHack tests need nle: pip install --no-deps nle")
from nle import nethack  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "NetHackScore-v0"
SHAPES = {"glyphs": nethack.DUNGEON_SHAPE, "blstats": nethack.BLSTATS_SHAPE}
NUM_ACTIONS = 23
WAIT_S = 240  # upper bound for the run across hosts; never reached when things work


def nethack_net(use_lstm=False, seed=0):
    torch.manual_seed(seed)
    flags = flag_helpers.make_flags(kind="nethack", use_lstm=use_lstm, hidden_size=32)
    return models.create_model(flags, SHAPES, NUM_ACTIONS)


def random_inputs(T, B, seed=0):
    generator = torch.Generator().manual_seed(seed)
    height, width = SHAPES["glyphs"]
    blstats = torch.randint(0, 100, (T, B, *SHAPES["blstats"]), generator=generator)
    blstats[..., 0] = torch.randint(0, width, (T, B), generator=generator)
    blstats[..., 1] = torch.randint(0, height, (T, B), generator=generator)
    return {
        "frame/glyphs": torch.randint(0, nethack.MAX_GLYPH, (T, B, height, width),
                                      generator=generator).to(torch.int16),
        "frame/blstats": blstats,
        "reward": torch.randn((T, B), generator=generator),
        "done": torch.rand((T, B), generator=generator) < 0.2,
        "last_action": torch.randint(0, NUM_ACTIONS, (T, B), generator=generator),
    }


# ----------------------------------------------------------------------------------------------
# The environment.

@pytest.mark.parametrize("env_id", ["NetHackScore-v0", "nle:NetHackStaircase-v0",
                                    "NetHackGold-v0"])
def test_nethack_ids_are_their_own_kind_with_only_what_the_model_reads(env_id):
    info = envs.env_info(flag_helpers.make_flags(env=env_id))
    assert info["kind"] == "nethack"
    assert info["observation_shape"] == SHAPES
    assert info["observation_dtype"] == {"glyphs": np.int16, "blstats": np.int64}
    assert (info["num_actions"], info["continuous"]) == (NUM_ACTIONS, False)


def test_observations_are_fresh_arrays():
    """NLE writes each step into the same arrays; create_env's environments return new ones."""
    env = envs.create_env(flag_helpers.make_flags(env=ENV))
    try:
        first, _ = env.reset(seed=0)
        kept = {key: value.copy() for key, value in first.items()}
        for step in range(10):
            later, *_ = env.step(step % 8)
        assert all(np.array_equal(first[key], kept[key]) for key in first)
        assert not any(np.shares_memory(first[key], later[key]) for key in first)
    finally:
        env.close()


def test_a_seed_replays_the_same_games():
    """Gymnasium's seed does not reach NetHack's generators; NetHackEnv seeds every game."""
    def first_screens(seed):
        adapter = envs.RolloutAdapter(envs.create_env(flag_helpers.make_flags(env=ENV)), seed)
        try:  # the first game's first screen, then the second game's
            return [adapter.initial()["frame/glyphs"], adapter.env.reset()[0]["glyphs"]]
        finally:
            adapter.close()

    first, again, other = first_screens(3), first_screens(3), first_screens(4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], first[1])  # a new game, not the first one again
    assert not np.array_equal(first[0], other[0])


@pytest.mark.parametrize("env_id,typed,expected", [
    ("NetHackScore-v0", None, -0.001), ("NetHackGold-v0", None, -0.001),
    ("NetHackStaircase-v0", None, -0.00001), ("NetHackStaircase-v0", -0.25, -0.25)])
def test_a_step_that_leaves_the_clock_still_costs_the_penalty(env_id, typed, expected):
    """Action 0 (MORE, with no message to page) takes no game time: its reward is the penalty,
    by default the paper's (-0.001, beside a success of 100 on the tasks that end there, which
    NLE now pays 1) instead of NLE's registered -0.01, or --penalty_step's."""
    env = envs.create_env(flag_helpers.make_flags(env=env_id, penalty_step=typed))
    try:
        env.reset(seed=1)
        rewards = [env.step(0)[1] for _ in range(5)]
    finally:
        env.close()
    assert rewards == pytest.approx([expected] * 5)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "NetHack-v0"])
def test_a_penalty_step_for_an_env_without_one_is_refused(env_id):
    with pytest.raises(ValueError, match="--penalty_step"):
        envs.create_env(flag_helpers.make_flags(env=env_id, penalty_step=-0.1))


# ----------------------------------------------------------------------------------------------
# The model.

@pytest.mark.parametrize("use_lstm", [False, True])
@pytest.mark.parametrize("T,B", [(1, 4), (5, 2)])
def test_output_shapes_for_t_by_b_inputs(use_lstm, T, B):
    net = nethack_net(use_lstm)
    assert type(net) is models.NetHackNet
    outputs, state = net(random_inputs(T, B), net.initial_state(B))
    assert outputs["policy_logits"].shape == (T, B, NUM_ACTIONS)
    assert outputs["baseline"].shape == (T, B) and outputs["action"].shape == (T, B)
    assert outputs["action"].dtype == torch.int64
    assert len(state) == (2 if use_lstm else 0)
    assert all(torch.isfinite(v).all() for v in outputs.values())


def test_the_kind_defaults_build_the_nethack_net():
    """--model nethack is the kind's default; a net of one array is never it."""
    flags = flag_helpers.make_flags(kind="nethack")
    net = models.create_model(flags, SHAPES, NUM_ACTIONS)
    assert type(net) is models.NetHackNet and net.core is None
    with pytest.raises(ValueError, match="--model nethack needs NLE's glyphs"):
        models.create_model(flags, (8,), NUM_ACTIONS)
    with pytest.raises(ValueError, match="--model nethack needs NLE's glyphs"):
        models.create_model(flags, {"glyphs": (21, 79)}, NUM_ACTIONS)


def test_crop_is_the_square_centred_on_column_x_row_y():
    """Every square of the map holds a different value, and the map is not square: a crop
    off by one, or with x and y swapped, has other values."""
    height, width = SHAPES["glyphs"]
    glyphs = torch.arange(height * width).view(1, height, width)
    fill = -1
    padded = np.pad(glyphs[0].numpy(), 4, constant_values=fill)
    for x, y in [(10, 5), (0, 0), (width - 1, height - 1), (3, 17), (70, 2)]:
        crop = models.crop_around(glyphs, torch.tensor([x]), torch.tensor([y]), 9, fill)
        assert crop.shape == (1, 9, 9)
        assert crop[0, 4, 4] == glyphs[0, y, x]
        np.testing.assert_array_equal(crop[0].numpy(), padded[y:y + 9, x:x + 9])


def test_the_net_crops_around_the_agent_of_a_real_game(monkeypatch):
    """The crop the net takes from NLE's observation is centred on the '@' that the screen
    shows (found in NLE's chars, which the net does not read)."""
    crops = []

    def recording(*args):
        crops.append(crop_around(*args))
        return crops[-1]

    crop_around = models.crop_around
    monkeypatch.setattr(models, "crop_around", recording)
    env = nethack_env.NetHackEnv(gymnasium.make(
        ENV, observation_keys=("glyphs", "blstats", "chars"), disable_env_checker=True))
    net = nethack_net()
    checked = 0
    try:
        observation, _ = env.reset(seed=0)
        for step in range(60):
            ats = np.argwhere(observation["chars"] == ord("@"))
            if len(ats) == 1:  # the agent alone (a shopkeeper or a watchman is an '@' too)
                (row, column), = ats
                inputs = {f"frame/{key}": torch.as_tensor(observation[key])[None, None]
                          for key in SHAPES}
                inputs.update(reward=torch.zeros(1, 1), done=torch.zeros(1, 1, dtype=torch.bool),
                              last_action=torch.zeros(1, 1, dtype=torch.int64))
                with torch.no_grad():
                    net(inputs)
                padded = np.pad(observation["glyphs"], 4, constant_values=nethack.MAX_GLYPH)
                np.testing.assert_array_equal(crops[-1][0].numpy(),
                                              padded[row:row + 9, column:column + 9])
                checked += 1
            observation, _, terminated, truncated, _ = env.step(step % 8)  # the 8 moves
            if terminated or truncated:
                observation, _ = env.reset()
    finally:
        env.close()
    assert checked >= 30


def test_test_mode_carries_the_lstm_state():
    """In eval mode (evaluation, --mode test) the net acts greedily, and T steps at once are
    T steps one at a time with the core state carried from each to the next."""
    net = nethack_net(use_lstm=True).eval()
    T, B = 6, 3
    inputs = random_inputs(T, B)
    inputs["done"][:] = False
    inputs["done"][3, 1] = True  # one episode starts mid-way: its state is reset there
    with torch.no_grad():
        whole, whole_state = net(inputs, net.initial_state(B))
        state, steps = net.initial_state(B), []
        for t in range(T):
            output, state = net({k: v[t:t + 1] for k, v in inputs.items()}, state)
            steps.append(output)
        fresh, _ = net({k: v[1:2] for k, v in inputs.items()}, net.initial_state(B))
    for key in ("policy_logits", "baseline"):
        torch.testing.assert_close(torch.cat([s[key] for s in steps]), whole[key])
    torch.testing.assert_close(state, whole_state)
    assert torch.equal(whole["action"], whole["policy_logits"].argmax(-1))
    # The carried state matters: step 1 from a fresh state acts on other numbers.
    assert not torch.allclose(fresh["policy_logits"], steps[1]["policy_logits"])


def test_gradients_reach_every_part_of_the_net():
    net = nethack_net(use_lstm=True)
    outputs, _ = net(random_inputs(4, 2))
    (outputs["baseline"].sum() + outputs["policy_logits"].logsumexp(-1).sum()).backward()
    missing = [name for name, p in net.named_parameters()
               if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


# ----------------------------------------------------------------------------------------------
# Both variants with no flag but --env.

def check_finite_losses(run_dir, at_least):
    rows = runlog.read_logs(run_dir / "logs.csv")
    assert rows and int(rows[-1]["step"]) >= at_least, rows
    for row in rows:
        for name in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss", "grad_norm"):
            assert math.isfinite(float(row[name])), (name, row)


def test_monobeast_trains_with_the_defaults_and_plays_test_mode(tmp_path, keep_process_state):
    """One batch of the kind's defaults (B=8, T=80: 640 steps), then --mode test."""
    args = ["--env", ENV, "--savedir", str(tmp_path), "--xpid", "nh", "--no_progress"]
    assert monobeast.main([*args, "--total_steps", "640"]) == 0
    saved = json.loads((tmp_path / "nh" / "flags.json").read_text())
    assert (saved["model"], saved["batch_size"], saved["unroll_length"]) == ("nethack", 8, 80)
    check_finite_losses(tmp_path / "nh", 640)
    assert monobeast.main([*args, "--mode", "test", "--test_episodes", "2",
                           "--eval_max_steps", "40"]) == 0
    (test,) = runlog.read_tests(str(tmp_path / "nh" / "tests.jsonl"))
    assert len(test["returns"]) == 2 and all(map(math.isfinite, test["returns"]))


@pytest.mark.slow
def test_polybeast_trains_with_the_defaults(tmp_path):
    result = subprocess.run([sys.executable, "-m", "polybeast", "--env", ENV, "--savedir",
                             str(tmp_path), "--xpid", "nh", "--no_progress",
                             "--total_steps", "1280"],
                            cwd=REPO, capture_output=True, text=True,
                            timeout=WAIT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    check_finite_losses(tmp_path / "nh", 1280)


@pytest.mark.skipif(netns.reason() is not None, reason=str(netns.reason()))
@pytest.mark.slow
def test_env_servers_on_another_host_serve_a_nethack_learner(tmp_path):
    """`python -m polybeast_env --env NetHackScore-v0` in one network namespace, the learner
    in another, over TCP: a short run ends with exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in distributed.ENV_VARS}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=REPO)
    with netns.Hosts() as hosts:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        servers = hosts.popen(0, [sys.executable, "-m", "polybeast_env", "--env", ENV,
                                  "--num_servers", "2", "--address",
                                  f"{hosts.address[0]}:{port}"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        learner = hosts.popen(1, [sys.executable, "-m", "polybeast", "--env", ENV,
                                  "--savedir", str(tmp_path / "runs"), "--xpid", "nh",
                                  "--no_progress", "--server_addresses",
                                  f"{hosts.address[0]}:{port},{hosts.address[0]}:{port + 1}",
                                  "--total_steps", "1280"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        _, err = learner.communicate(timeout=WAIT_S)
        assert learner.returncode == 0, err[-3000:]
        assert "reached over the network" in err  # the warning for non-loopback servers
        assert servers.poll() is None  # the servers outlive their learner
    check_finite_losses(tmp_path / "runs" / "nh", 1280)
