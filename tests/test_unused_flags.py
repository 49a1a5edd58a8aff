"""A typed flag that would do nothing in its run is refused with what to change
(beast/unused_flags.py, monobeast.unused_layout_flags, beast/poly/layout.py), and a flag
that is not typed (a default, a resumed run's saved value) is never refused for it."""

import json
import os

import pytest

import monobeast
from beast import unused_flags
from beast.poly import layout
from tests import flag_helpers

TINY = ["--num_actors", "1", "--batch_size", "2", "--unroll_length", "20", "--no_progress"]


def typed(flags, *names):
    flags.typed = set(names)
    flags.given = set(names)
    return flags


def test_test_mode_refuses_each_typed_training_flag_and_takes_the_ones_it_reads():
    flags = typed(flag_helpers.make_flags(mode="test", xpid="r"), "mode", "xpid", "learning_rate",
                  "num_learner_threads", "test_episodes", "eval_policy", "env", "noop_max",
                  "record_video", "seed")
    found = unused_flags.problems(flags)
    assert [p.split()[0] for p in found] == ["--learning_rate", "--num_learner_threads"], found
    assert "has no effect with --mode test" in found[0] and "--xpid r" in found[0]


def test_training_refuses_test_episodes_and_evaluation_flags_while_evaluation_is_off():
    flags = typed(flag_helpers.make_flags(), "test_episodes", "eval_episodes", "eval_policy")
    found = unused_flags.problems(flags)
    assert len(found) == 3 and found[0].startswith("--test_episodes is for --mode test"), found
    assert "--eval_episodes has no effect without --eval_interval_steps N" in found[1]
    assert "--eval_policy has no effect without --eval_interval_steps N or " in found[2]
    # A video plays its game with --eval_policy, but only an evaluation plays --eval_episodes.
    flags.eval_video_interval_steps = 1000
    assert [p.split()[0] for p in unused_flags.problems(flags)] == [
        "--test_episodes", "--eval_episodes"]
    flags.eval_interval_steps = 1000
    assert [p.split()[0] for p in unused_flags.problems(flags)] == ["--test_episodes"]
    # Not typed: the same values are the defaults, or a resumed run's, and are nobody's mistake.
    assert unused_flags.problems(typed(flags)) == []


def test_a_resume_refuses_another_init_and_takes_the_same_one():
    flags = typed(flag_helpers.make_flags(init="orthogonal"), "init")
    (problem,) = unused_flags.problems(flags, saved_flags={"init": "torch"})
    assert "a resume keeps its checkpoint's (this run's were --init torch)" in problem
    assert unused_flags.problems(flags, saved_flags={"init": "orthogonal"}) == []
    assert unused_flags.problems(flags, saved_flags=None) == []  # a new run: it takes effect


def test_monobeast_refuses_serial_and_deterministic_layout_flags_before_writing_anything(
        tmp_path, capsys):
    base = ["--env", "CartPole-v1", "--savedir", str(tmp_path), "--no_progress"]
    assert monobeast.main([*base, "--num_actors", "0", "--envs_per_actor", "2",
                           "--num_learner_threads", "2", "--batch_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--envs_per_actor has no effect with --num_actors 0" in err
    assert "--num_learner_threads has no effect with --num_actors 0" in err
    assert monobeast.main([*base, "--deterministic", "--actor_timeout_s", "5"]) == 2
    assert "--actor_timeout_s has no effect with --deterministic" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_a_trained_run_refuses_training_flags_in_test_mode_and_a_new_init_on_resume(
        tmp_path, capsys):
    base = ["--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "r"]
    assert monobeast.main([*base, *TINY, "--total_steps", "200"]) == 0
    capsys.readouterr()
    assert monobeast.main(["--mode", "test", "--savedir", str(tmp_path), "--xpid", "r",
                           "--test_episodes", "1", "--num_actors", "9",
                           "--learning_rate", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--num_actors has no effect with --mode test" in err
    assert "--learning_rate has no effect with --mode test" in err
    assert "--num_buffers" not in err  # no advice about a layout that test never builds
    assert not (tmp_path / "r" / "tests.jsonl").exists()
    assert monobeast.main([*base, *TINY, "--total_steps", "400", "--init", "orthogonal"]) == 2
    assert "--init chooses a new run's weights" in capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "flags.json").read_text())["total_steps"] == 200
    # The flags saved by the first start (typed ones included) do not count as typed now.
    assert monobeast.main(["--mode", "test", "--savedir", str(tmp_path), "--xpid", "r",
                           "--test_episodes", "1"]) == 0


@pytest.mark.parametrize("env, flag, expected", [
    ("MinAtar/Breakout-v1", ["--hidden_size", "64"],
     "--hidden_size has no effect on ResNet (--model resnet): leave it out, or choose a "
     "--model that reads it (small, mlp, nethack)."),
    ("CartPole-v1", ["--channels", "8,16,16"],
     "--channels has no effect on MLP (--model mlp): leave it out, or choose a --model that "
     "reads it (resnet)."),
    # The image kind's --model default is resnet, but a Dict observation gets DictNet: the
    # message names DictNet and asks for no --model.
    ("tests.dict_obs_env:DictCue-v0", ["--channels", "8,16,16"],
     "--channels has no effect on DictNet, the net of tests.dict_obs_env:DictCue-v0's Dict "
     "observation: leave it out."),
], ids=["hidden_size-resnet", "channels-mlp", "channels-dictnet"])
def test_a_width_flag_is_refused_for_a_net_that_does_not_read_it(tmp_path, capsys, env, flag,
                                                                 expected):
    if env.startswith("MinAtar"):
        pytest.importorskip("minatar", reason="MinAtar is installed by the set-up")
    assert monobeast.main(["--env", env, "--savedir", str(tmp_path), *flag]) == 2
    assert expected in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_polybeast_refuses_two_places_for_the_servers_and_a_rank_timeout_without_ranks(
        monkeypatch):
    import polybeast

    flags = flag_helpers.make_flags(parser=polybeast.make_parser(),
                                    server_addresses="unix:/tmp/x.0", pipes_basename="unix:/tmp/y")
    flags.given = set(layout.PER_START_FLAGS)  # given on every start, typed or not
    flags.typed = set()
    assert layout.check_servers(flags) == []
    flags.typed = {"server_addresses", "pipes_basename"}
    assert layout.check_servers(flags) == [
        "--server_addresses and --pipes_basename both say where the env servers listen: "
        "give one."]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags.typed = {"dist_timeout_s"}
    assert "--dist_timeout_s is for learner ranks" in layout.unused_rank_flags(flags)[0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert layout.unused_rank_flags(flags) == []


def test_polybeast_says_that_servers_started_elsewhere_play_their_own_environment_flags():
    import io

    import polybeast

    flags = flag_helpers.make_flags(parser=polybeast.make_parser(), no_start_servers=True)
    flags.typed = {"env", "noop_max", "num_actors"}
    out = io.StringIO()
    layout.note_env_flags_of_remote_servers(flags, out)
    assert "--noop_max typed here reach only this learner's evaluation" in out.getvalue()
    assert "--env" not in out.getvalue() and "python -m polybeast_env" in out.getvalue()
    flags.no_start_servers = False  # servers started here get them on their command lines
    out = io.StringIO()
    layout.note_env_flags_of_remote_servers(flags, out)
    assert out.getvalue() == ""
