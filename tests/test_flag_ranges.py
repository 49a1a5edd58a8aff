"""Every numeric flag declares its range where it is declared (beast.flags.Number), and the
start-up checks refuse NaN, inf and values beyond the range, one message per flag naming it.

The test walks every numeric flag of MonoBeast's, PolyBeast's and polybeast_env's parsers, so
a flag added without a range, or with one the checks do not enforce, fails here.
"""

import argparse
import math
import os
import types

import pytest

import monobeast
import polybeast
import polybeast_env
from beast import flags as beast_flags

PARSERS = {"monobeast": monobeast.make_parser, "polybeast": polybeast.make_parser,
           "polybeast_env": polybeast_env.make_parser}


def numeric_flags():
    """(parser name, flag dest) of every int or float flag of every parser."""
    cases = []
    for name, make_parser in PARSERS.items():
        for action in make_parser()._actions:
            if action.option_strings and (action.type in (int, float)
                                          or isinstance(action.type, beast_flags.Number)):
                cases.append((name, action.dest))
    return cases


NUMERIC_FLAGS = numeric_flags()


def action_of(parser, dest):
    return next(a for a in parser._actions if a.dest == dest and a.option_strings)


def valid_flags(name, kind="vector"):
    """The parser's defaults, filled in as a run fills them before its checks."""
    parser = PARSERS[name]()
    flags = parser.parse_args(["--pipes_basename=unix:/tmp/x"] if name == "polybeast_env"
                              else [])
    if name != "polybeast_env":
        beast_flags.apply_env_defaults(flags, kind)
        flags.num_torch_threads = 1
    return parser, flags


def problems_of(name, parser, flags):
    """What the start-up checks of `name` report, called directly."""
    if name == "polybeast_env":
        return polybeast_env.flag_problems(flags, parser)
    try:
        beast_flags.validate_flags(flags, parser=parser)
    except beast_flags.FlagError as error:
        return error.problems
    return []


def out_of_range_values(number):
    """Values beyond `number`'s bounds (at an exclusive bound, just past an inclusive one)."""
    step = 1 if number.kind is int else 1e-9
    values = []
    if number.low is not None:
        values.append(number.low - step)
    if number.above is not None:
        values.append(number.above)
    if number.high is not None:
        values.append(number.high + step)
    if number.below is not None:
        values.append(number.below)
    return values


def test_the_walk_finds_the_flags_of_every_parser():
    names = {name for name, _ in NUMERIC_FLAGS}
    assert names == set(PARSERS)
    dests = {dest for _, dest in NUMERIC_FLAGS}
    assert {"learning_rate", "entropy_cost", "checkpoint_interval_s", "eval_episodes",
            "num_actors", "actor_timeout_s", "envs_per_stream", "stream_timeout_s",
            "num_servers", "step_timeout_s"} <= dests


@pytest.mark.parametrize("name, dest", NUMERIC_FLAGS, ids=[f"{n}-{d}" for n, d in NUMERIC_FLAGS])
def test_every_numeric_flag_declares_its_range(name, dest):
    action = action_of(PARSERS[name](), dest)
    assert isinstance(action.type, beast_flags.Number), (
        f"{action.option_strings[0]} of {name} has type {action.type!r}: declare its range "
        "with beast.flags.Number")


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("kind", list(beast_flags.KIND_LABELS))
def test_the_defaults_pass(name, kind):
    parser, flags = valid_flags(name, kind)
    assert problems_of(name, parser, flags) == []


@pytest.mark.parametrize("name, dest", NUMERIC_FLAGS, ids=[f"{n}-{d}" for n, d in NUMERIC_FLAGS])
def test_nan_inf_and_out_of_range_values_are_refused_naming_the_flag(name, dest):
    parser, _ = valid_flags(name)
    action = action_of(parser, dest)
    number = action.type
    option = action.option_strings[0]
    bad = [math.nan, -math.inf] + out_of_range_values(number)
    if not number.infinite:
        bad.append(math.inf)
    if number.kind is int:
        bad += [2.5, True]  # e.g. from a hand-edited flags.json
    for value in bad:
        _, flags = valid_flags(name)
        setattr(flags, dest, value)
        problems = problems_of(name, parser, flags)
        mine = [p for p in problems if p.startswith(f"{option} ")]
        assert len(mine) == 1, (value, problems)
        assert repr(value) in mine[0] and number.describe() in mine[0], mine[0]


@pytest.mark.parametrize("name, dest", NUMERIC_FLAGS, ids=[f"{n}-{d}" for n, d in NUMERIC_FLAGS])
def test_values_at_the_bounds_pass(name, dest):
    parser, _ = valid_flags(name)
    number = action_of(parser, dest).type
    good = [v for v in (number.low, number.high) if v is not None]
    if number.infinite:
        good.append(math.inf)
    for value in good:
        _, flags = valid_flags(name)
        setattr(flags, dest, value)
        problems = [p for p in problems_of(name, parser, flags) if f"--{dest} " in p]
        assert problems == [], (value, problems)


def test_inf_means_no_limit_where_a_flag_takes_it():
    """A flag that takes inf says what it means in its help."""
    for name, dest in NUMERIC_FLAGS:
        action = action_of(PARSERS[name](), dest)
        if action.type.infinite:
            assert "inf:" in action.help, action.option_strings[0]


def test_every_problem_is_reported_at_once_through_the_learner(tmp_path, capsys,
                                                               keep_process_state):
    """The three that used to pass: --entropy_cost inf (it failed 5 s into the run),
    --checkpoint_interval_s -5 (taken silently) and --eval_episodes 0 (NumPy's warnings on
    an empty evaluation): refused together before anything is written, exit status 2."""
    argv = ["--savedir", str(tmp_path), "--xpid", "bad", "--entropy_cost", "inf",
            "--checkpoint_interval_s", "-5", "--eval_episodes", "0", "--num_actors", "-1"]
    assert monobeast.main(argv) == 2
    err = capsys.readouterr().err
    for text in ("--entropy_cost must be a finite number >= 0 (got inf)",
                 "--checkpoint_interval_s must be a finite number >= 0 or inf (got -5.0)",
                 "--eval_episodes must be an integer >= 1 (got 0)",
                 "--num_actors must be an integer >= 0 (got -1)"):
        assert text in err, err
    assert err.count("--entropy_cost") == 1  # checked by both the variant and the skeleton
    assert not os.path.exists(tmp_path / "bad")


def test_the_variants_check_their_own_flags():
    flags = monobeast.make_parser().parse_args(["--actor_timeout_s", "nan"])
    beast_flags.apply_env_defaults(flags, "vector")
    problems = monobeast.resolve_flags(flags, types.SimpleNamespace(kind="vector"))
    assert any(p.startswith("--actor_timeout_s must be") for p in problems), problems
    flags = polybeast.make_parser().parse_args(
        ["--stream_timeout_s", "-1", "--envs_per_stream", "100000"])
    beast_flags.apply_env_defaults(flags, "vector")
    problems = polybeast.resolve_flags(flags, types.SimpleNamespace(kind="vector"))
    assert any(p.startswith("--stream_timeout_s must be") for p in problems), problems
    assert any(p.startswith("--envs_per_stream must be an integer in [1, ") for p in problems)


def test_number_describes_its_range():
    Number = beast_flags.Number
    assert Number(int, low=1).describe() == "an integer >= 1"
    assert Number(float, 0, 1).describe() == "a finite number in [0, 1]"
    assert Number(float, low=0, below=1).describe() == "a finite number in [0, 1)"
    assert Number(float, above=0, infinite=True).describe() == "a finite number > 0 or inf"
    assert Number(float).describe() == "a finite number"
    parser = argparse.ArgumentParser()
    parser.add_argument("--x", type=Number(float, above=0))
    assert parser.parse_args(["--x", "-3"]).x == -3.0  # converted; checked with the others
    with pytest.raises(SystemExit):
        parser.parse_args(["--x", "abc"])
