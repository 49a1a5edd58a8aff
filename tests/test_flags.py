"""beast/flags.py: help text that states the defaults that apply, the per-kind defaults, the
environment flags shared with polybeast_env, and env server addresses."""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import polybeast_env
from beast import checkpoint as ckpt
from beast import flags as beast_flags
from beast.flags import ENV_DEFAULTS, KIND_LABELS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_TIMEOUT_S = 30


def common_parser():
    parser = argparse.ArgumentParser(formatter_class=beast_flags.HelpFormatter)
    beast_flags.add_common_flags(parser)
    return parser


def env_parser():
    parser = argparse.ArgumentParser(formatter_class=beast_flags.HelpFormatter)
    return beast_flags.add_env_flags(parser)


def action_for(parser, dest):
    return next((a for a in parser._actions if a.dest == dest and a.option_strings), None)


def env_actions(parser):
    return [a for a in parser._actions if a.dest in beast_flags.env_flag_names()]


def value_type(action):
    """int or float for a numeric flag (its Number's kind), else the action's type."""
    return action.type.kind if isinstance(action.type, beast_flags.Number) else action.type


# ---------------------------------------------------------------------------------------------
# Help text, read back from the rendered --help.


def rendered_help(parser):
    """{"--flag": its help text as `--help` prints it, wrapped lines joined}."""
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        start = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if start:
            current = start.group(1).split(",")[0].split()[0]
            entries[current] = start.group(2) or ""
        elif current is not None and line.startswith("    ") and line.strip():
            text = entries[current]
            # textwrap breaks after hyphens ("one-" / "environment"): join those without a space.
            joiner = "" if re.search(r"\w-$", text) else " "
            entries[current] = (text + joiner + line.strip()) if text else line.strip()
        else:
            current = None
    return entries


def stated_defaults(help_text, action):
    """The "(default: ...)" of a help text as {kind: value}, in the action's type."""
    match = re.search(r"\(default: ([^()]*)\)", help_text)
    if match is None:
        return None

    def value_of(text):
        if isinstance(action, argparse.BooleanOptionalAction):
            return {"on": True, "off": False}[text]
        if value_type(action) is int:
            return int(text.replace(",", ""))
        if value_type(action) is float:
            return float(text)
        if action.type is beast_flags.channel_list:
            return action.type(text)
        return text

    kind_of_label = {label: kind for kind, label in KIND_LABELS.items()}
    segments = match.group(1).split(", ")
    if len(segments) == 1 and " " not in segments[0]:
        return {kind: value_of(segments[0]) for kind in KIND_LABELS}
    stated = {}
    for segment in segments:
        text, _, label = segment.partition(" ")
        if label not in kind_of_label:
            return {"unreadable": segment}
        stated[kind_of_label[label]] = value_of(text)
    return stated


def help_default_problems(parser):
    """Every flag of ENV_DEFAULTS whose --help does not state exactly the table's values."""
    helps = rendered_help(parser)
    problems = []
    for key in ENV_DEFAULTS["atari"]:
        action = action_for(parser, key)
        if action is None:
            continue
        option = action.option_strings[0]
        stated = stated_defaults(helps[option], action)
        wanted = {kind: ENV_DEFAULTS[kind][key] for kind in KIND_LABELS}
        if stated != wanted:
            problems.append(f"{option}: help says {stated}, ENV_DEFAULTS has {wanted}")
    return problems


@pytest.fixture(autouse=True)
def fixed_help_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


def test_every_env_default_is_a_flag_of_the_learners():
    parser = common_parser()
    for kind in ENV_DEFAULTS:
        missing = [key for key in ENV_DEFAULTS[kind] if action_for(parser, key) is None]
        assert not missing, f"ENV_DEFAULTS[{kind!r}] has keys that no flag declares: {missing}"
        assert all(action_for(parser, key).default is None for key in ENV_DEFAULTS[kind])


def test_env_defaults_cover_every_kind_with_the_same_keys():
    assert list(ENV_DEFAULTS) == list(KIND_LABELS)
    keys = [sorted(table) for table in ENV_DEFAULTS.values()]
    assert all(k == keys[0] for k in keys), keys


@pytest.mark.parametrize("make_parser", [common_parser, polybeast_env.make_parser],
                         ids=["add_common_flags", "polybeast_env"])
def test_help_states_the_env_defaults_table(make_parser):
    parser = make_parser()
    assert help_default_problems(parser) == []
    if make_parser is common_parser:
        helps = rendered_help(parser)
        # Spot checks of the reader itself, against the values the issue named.
        assert ("(default: 20 Atari, 20 sticky Atari, 20 other images, 80 vector, 20 "
                "continuous control, 80 NetHack)" in helps["--unroll_length"])
        assert ("0.0006 Atari, 0.01 sticky Atari, 0.01 other images, 0.005 vector, 0.0 "
                "continuous control, 0.001 NetHack" in helps["--entropy_cost"])
        assert ("(default: 16,32,32 Atari, 8,16,16 sticky Atari, 16,32,32 other images"
                in helps["--channels"])


def test_a_stale_hand_written_help_string_is_caught():
    """The help strings this file replaced: they named two kinds and the old vector values."""
    parser = argparse.ArgumentParser(formatter_class=beast_flags.HelpFormatter)
    parser.add_argument("--unroll_length", type=int, default=None,
                        help="Steps T per rollout (default: 80 Atari, 20 vector).")
    parser.add_argument("--entropy_cost", type=float, default=None,
                        help="Entropy cost (default: 0.0006 Atari, 0.01 vector).")
    parser.add_argument("--hidden_size", type=int, default=None,
                        help="Width of the MLP's hidden layers (default: 64).")
    problems = help_default_problems(parser)
    assert len(problems) == 3, problems


def test_describe_defaults():
    table = {"atari": {"n": 4}, "sticky_atari": {"n": 8}, "image": {"n": 32},
             "vector": {"n": 32}, "continuous": {"n": 16}, "nethack": {"n": 8}}
    described = ("4 Atari, 8 sticky Atari, 32 other images, 32 vector, 16 continuous control, "
                 "8 NetHack")
    assert beast_flags.describe_defaults(table, "n") == described
    assert beast_flags.describe_defaults({kind: row["n"] for kind, row in table.items()}) == \
        described
    assert beast_flags.describe_defaults({k: 1_500_000 for k in KIND_LABELS}) == "1,500,000"
    assert beast_flags.describe_defaults({k: 5e-05 for k in KIND_LABELS}) == "5e-05"
    assert beast_flags.describe_defaults({k: True for k in KIND_LABELS}) == "on"
    with pytest.raises(ValueError, match="vector"):
        beast_flags.describe_defaults({"atari": 4, "image": 32})
    with pytest.raises(ValueError, match="'n' for sticky_atari, image"):
        beast_flags.describe_defaults({"atari": {"n": 4}, "image": {}, "vector": {"n": 1}}, "n")


# ---------------------------------------------------------------------------------------------
# apply_env_defaults.


def other_value(action, value):
    """A valid value of this flag that differs from `value` (which may be None)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return not value
    if action.choices:
        return next(c for c in action.choices if c != value)
    if value_type(action) is int:
        return 7 if value is None else value + 1
    if value_type(action) is float:
        return -0.5 if value is None else value * 2 + 0.125  # negative: "--x=-0.5" must parse
    if action.type in (str, None):
        return "-odd/Id-v0" if value is None else value + "x"
    if action.type is beast_flags.channel_list:
        return [4] if value is None else value + [4]
    raise AssertionError(f"no other value for {action.option_strings[0]}: teach other_value")


def as_argv(action, value):
    option = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [option if value else action.option_strings[1]]
    if isinstance(value, list):
        return [f"{option}={','.join(map(str, value))}"]
    return [f"{option}={value}"]


@pytest.mark.parametrize("kind", list(KIND_LABELS))
def test_apply_env_defaults_fills_every_none_flag(kind):
    flags = common_parser().parse_args([])
    assert beast_flags.apply_env_defaults(flags, kind) is flags
    for key, value in ENV_DEFAULTS[kind].items():
        assert getattr(flags, key) == value and type(getattr(flags, key)) is type(value), key


@pytest.mark.parametrize("kind", list(KIND_LABELS))
def test_apply_env_defaults_never_overrides_a_given_flag(kind):
    parser = common_parser()
    given = {key: other_value(action_for(parser, key), value)
             for key, value in ENV_DEFAULTS[kind].items()}
    argv = [arg for key, value in given.items() for arg in as_argv(action_for(parser, key), value)]
    flags = parser.parse_args(argv)
    beast_flags.apply_env_defaults(flags, kind)
    assert {key: getattr(flags, key) for key in given} == given


def test_a_run_saved_before_a_flag_resumes_with_what_it_did_then():
    """--pg_clip came after runs were saved, and is on by default for images: a run whose
    flags.json lacks it resumes with the trust region off, as it trained, unless it is typed;
    a run saved with it keeps its value."""
    def resumed(argv, saved):
        flags = common_parser().parse_args(argv)
        ckpt.merge_saved_flags(flags, saved, beast_flags.explicit_flags(
            common_parser(), argv))
        return beast_flags.apply_env_defaults(flags, "image")

    assert ENV_DEFAULTS["image"]["pg_clip"] > 0
    assert resumed([], {"entropy_cost": 0.01}).pg_clip == 0.0
    assert resumed([], {"pg_clip": 0.3}).pg_clip == 0.3
    assert resumed(["--pg_clip", "0.1"], {"entropy_cost": 0.01}).pg_clip == 0.1
    assert resumed([], {}).entropy_cost == ENV_DEFAULTS["image"]["entropy_cost"]


def test_old_saved_flags_are_brought_up_to_date_in_one_place():
    """A flags.json written before some flags existed: merge_saved_flags fills each missing
    flag from the parser's default (or the env default), except those of BEFORE_THE_FLAG,
    which keep the run doing what it did; a saved flag the parser no longer has is dropped.
    After it, every flag the code reads is there and in range."""
    parser = common_parser()
    saved = {key: value for key, value in vars(resumed_flags(parser, [], {})).items()
             if key not in ("reward_scale", "lr_warmup_steps", "eval_max_steps",
                            "acting_precision", "precision", "pg_clip", "given")}
    saved.update(env="CartPole-v1", learning_rate=0.002, retired_flag=3)
    flags = resumed_flags(parser, ["--total_steps", "5000"], saved)
    assert flags.reward_scale == 1.0 != ENV_DEFAULTS["vector"]["reward_scale"]
    assert flags.lr_warmup_steps == 0 != ENV_DEFAULTS["vector"]["lr_warmup_steps"]
    assert flags.pg_clip == 0.0
    assert flags.eval_max_steps == action_for(parser, "eval_max_steps").default
    assert (flags.acting_precision, flags.precision) == ("fp32", "fp32")
    assert flags.learning_rate == 0.002 and flags.total_steps == 5000
    assert not hasattr(flags, "retired_flag")
    flags.num_torch_threads = 1
    beast_flags.validate_flags(flags)


def test_a_sticky_atari_run_saved_with_the_atari_net_resumes_as_it_trained():
    """ALE/*-v5 runs saved while they took the Atari kind's defaults keep their network,
    batch and loss (its entropy cost too) on a resume under the sticky kind's, also one
    saved before --channels."""
    parser = common_parser()
    saved = vars(resumed_flags(parser, [], {}, kind="atari")).copy()
    saved.update(env="ALE/Pong-v5")
    for before_channels in (False, True):
        if before_channels:
            del saved["channels"]
        flags = resumed_flags(parser, [], saved, kind="sticky_atari")
        assert (flags.model, flags.batch_size, flags.pg_clip, flags.channels,
                flags.entropy_cost) == ("atari", 4, 0.0, [16, 32, 32], 0.0006)
        ckpt.check_compatible(saved, flags)


def test_a_resume_chooses_the_machine_s_flags_again_unless_the_run_typed_them():
    """precision, acting_precision and num_torch_threads fit the machine a run runs on: a
    run saved with bf16 on a CPU with bf16 instructions resumes in float32 on one without
    (emulated bf16 is many times slower), and the reverse; a precision typed at the run's
    start, or on the resume, stays, also through a later resume that does not type it."""
    parser = common_parser()
    saved = ckpt.plain_flags(resumed_flags(parser, ["--env", "ALE/Pong-v5"], {},
                                           kind="sticky_atari"))
    saved.update(precision="bf16", acting_precision="bf16", num_torch_threads=1,
                 given=str({"env"}))

    def resume_on(cpu_bf16, argv=(), saved=saved):
        flags = resumed_flags(parser, list(argv), saved, kind="sticky_atari")
        beast_flags.resolve_precisions(flags, "cpu", cpu_bf16=cpu_bf16)
        return flags

    def resumed_on(cpu_bf16, argv=(), saved=saved):
        flags = resume_on(cpu_bf16, argv, saved)
        return flags.precision, flags.acting_precision, flags.num_torch_threads

    assert resumed_on("none (emulated)") == ("fp32", "fp32", None)
    saved_without_bf16 = {**saved, "precision": "fp32", "acting_precision": "fp32"}
    assert resumed_on("AMX", saved=saved_without_bf16)[:2] == ("bf16", "bf16")
    assert resumed_on("none (emulated)", ["--precision", "bf16"])[:2] == ("bf16", "fp32")
    typed_then = {**saved, "given": str({"env", "precision"})}
    assert resumed_on("none (emulated)", saved=typed_then)[:2] == ("bf16", "fp32")
    resumed_once = ckpt.plain_flags(resume_on("AMX", saved=typed_then))
    assert resumed_on("none (emulated)", saved=resumed_once)[:2] == ("bf16", "fp32")
    no_flag_given = {**saved, "given": "set()"}
    assert resumed_on("none (emulated)", saved=no_flag_given)[:2] == ("fp32", "fp32")
    # A run saved before flags.json recorded what was given keeps what it saved.
    before_given = {k: v for k, v in saved.items() if k != "given"}
    assert resumed_on("none (emulated)", saved=before_given) == ("bf16", "bf16", 1)


def resumed_flags(parser, argv, saved, kind="vector"):
    flags = parser.parse_args(argv)
    flags.given = beast_flags.explicit_flags(parser, argv)
    ckpt.merge_saved_flags(flags, saved, flags.given)
    return beast_flags.apply_env_defaults(flags, kind)


def test_a_run_that_changes_its_list_flags_leaves_the_table_alone():
    flags = beast_flags.apply_env_defaults(common_parser().parse_args([]), "sticky_atari")
    flags.channels.append(32)
    assert ENV_DEFAULTS["sticky_atari"]["channels"] == [8, 16, 16]


def test_apply_env_defaults_rejects_an_unknown_kind_and_honours_names():
    flags = common_parser().parse_args([])
    with pytest.raises(ValueError, match="unknown environment kind 'pixels'"):
        beast_flags.apply_env_defaults(flags, "pixels")
    beast_flags.apply_env_defaults(flags, "atari", names=beast_flags.env_flag_names())
    assert flags.episodic_life is ENV_DEFAULTS["atari"]["episodic_life"]
    assert flags.unroll_length is None and flags.model is None
    # A script's own table of the same shape.
    flags.envs_per_actor = None
    beast_flags.apply_env_defaults(flags, "image",
                                   table={"atari": {"envs_per_actor": 4},
                                          "image": {"envs_per_actor": 32},
                                          "vector": {"envs_per_actor": 16}})
    assert flags.envs_per_actor == 32


def test_image_default_model_fits_small_and_large_frames():
    """ENV_DEFAULTS["image"] names the ResNet because the Atari net cannot take MinAtar's frames."""
    from beast import models

    model_flags = beast_flags.apply_env_defaults(common_parser().parse_args([]),
                                                 "image")
    for shape in [(4, 10, 10), (6, 10, 10), (4, 84, 84)]:
        models.create_model(model_flags, shape, num_actions=3)
    model_flags.model = "atari"
    with pytest.raises(ValueError):
        models.create_model(model_flags, (4, 10, 10), 3)


# ---------------------------------------------------------------------------------------------
# The environment flags, shared with polybeast_env.


def test_env_flags_are_declared_once_for_learners_and_env_servers():
    def described(parser):
        return [(a.option_strings, a.dest, a.default, a.type, a.choices, a.help, type(a))
                for a in env_actions(parser)]

    assert [a.dest for a in env_actions(common_parser())] == beast_flags.env_flag_names()
    assert set(beast_flags.env_flag_names()) >= {
        "env", "env_backend", "episodic_life", "repeat_action_probability"}
    assert described(common_parser()) == described(env_parser())
    assert described(polybeast_env.make_parser()) == described(env_parser())
    for own in ("seed", "envs_per_stream", "num_servers", "pipes_basename", "address",
                "exit_with_parent"):
        assert action_for(polybeast_env.make_parser(), own) is not None, own


@pytest.mark.parametrize("episodic_life", [True, False])
def test_env_flag_args_round_trips(episodic_life):
    learner_flags = common_parser().parse_args([])
    for action in env_actions(env_parser()):
        setattr(learner_flags, action.dest, other_value(action, action.default))
    learner_flags.episodic_life = episodic_life
    args = beast_flags.env_flag_args(learner_flags)
    wanted = {name: getattr(learner_flags, name) for name in beast_flags.env_flag_names()}
    for parser in (env_parser(), polybeast_env.make_parser()):
        parsed = parser.parse_args(args)
        assert {name: getattr(parsed, name) for name in wanted} == wanted, args


def test_env_flag_args_of_the_defaults_round_trips():
    flags = common_parser().parse_args([])
    args = beast_flags.env_flag_args(flags)
    assert "--repeat_action_probability" not in " ".join(args)  # None: left to the parser
    parsed = env_parser().parse_args(args)
    assert vars(parsed) == {name: getattr(flags, name) for name in beast_flags.env_flag_names()}
    flags.env = None
    with pytest.raises(ValueError, match="--env"):
        beast_flags.env_flag_args(flags)


def test_repeat_action_probability_is_checked():
    flags = common_parser().parse_args(["--repeat_action_probability", "1.5"])
    beast_flags.apply_env_defaults(flags, "atari")
    with pytest.raises(beast_flags.FlagError,
                       match=re.escape("--repeat_action_probability must be a finite number in "
                                       "[0, 1] (got 1.5)")):
        beast_flags.validate_flags(flags)
    flags.repeat_action_probability = 0.0
    beast_flags.validate_flags(flags)


def test_polybeast_env_reports_every_bad_flag_at_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        polybeast_env.main(["--envs_per_stream", "0", "--repeat_action_probability", "-1",
                            "--address", "nohost"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    for flag in ("--envs_per_stream", "--repeat_action_probability", "nohost"):
        assert flag in message, message
    with pytest.raises(SystemExit):
        polybeast_env.main(["--num_servers", "0"])
    assert "--num_servers must be an integer >= 1" in capsys.readouterr().err


def test_polybeast_env_refuses_an_address_and_a_socket_basename_together(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        polybeast_env.main(["--env", "CartPole-v1", "--address", "127.0.0.1:5599",
                            "--pipes_basename", f"unix:{tmp_path}/s"])
    assert exit_info.value.code == 2
    assert "--address and --pipes_basename both say where to serve" in capsys.readouterr().err


def test_polybeast_env_fills_episodic_life_from_the_env_kind():
    flags = polybeast_env.make_parser().parse_args(["--env", "CartPole-v1"])
    assert flags.episodic_life is None
    polybeast_env.resolve_env_flags(flags)
    assert flags.episodic_life is ENV_DEFAULTS["vector"]["episodic_life"]
    assert flags.repeat_action_probability is None  # the id's own value: no table entry
    flags = polybeast_env.make_parser().parse_args(["--env", "ALE/Pong-v5", "--episodic_life"])
    assert polybeast_env.resolve_env_flags(flags).episodic_life is True
    flags = polybeast_env.make_parser().parse_args(["--env", "CartPole-v1", "--episodic_life"])
    with pytest.raises(ValueError, match="--episodic_life is for atari environments only"):
        polybeast_env.resolve_env_flags(flags)  # ends episodes at a lost life: CartPole has none


@pytest.mark.slow
def test_polybeast_env_serves_atari_standalone(tmp_path):
    """python -m polybeast_env --env ALE/Pong-v5, without a learner's flags."""
    socket = tmp_path / "pb.0"
    process = subprocess.Popen(
        [sys.executable, "-m", "polybeast_env", "--env", "ALE/Pong-v5", "--num_servers", "1",
         "--pipes_basename", f"unix:{tmp_path}/pb"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not socket.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert socket.exists(), "no socket; polybeast_env said: " + (
            process.communicate(timeout=JOIN_TIMEOUT_S)[1] if process.poll() is not None else "")
        # It says "serving" a moment after the socket appears: a SIGTERM before then (on a
        # loaded machine) would stop it before it says so.
        serving = process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=JOIN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=JOIN_TIMEOUT_S)
    assert process.returncode == 0, err
    assert "serving ALE/Pong-v5" in serving + out


def test_adam_takes_its_own_epsilon_unless_one_is_typed():
    flags = common_parser().parse_args(["--optimizer", "adam"])
    beast_flags.apply_optimizer_defaults(flags)
    beast_flags.apply_env_defaults(flags, "atari")
    assert flags.epsilon == beast_flags.ADAM_EPSILON != beast_flags.ENV_DEFAULTS["atari"]["epsilon"]
    typed = common_parser().parse_args(["--optimizer", "adam", "--epsilon", "0.003"])
    assert beast_flags.apply_optimizer_defaults(typed).epsilon == 0.003
    rmsprop = common_parser().parse_args([])
    beast_flags.apply_optimizer_defaults(rmsprop)
    beast_flags.apply_env_defaults(rmsprop, "atari")
    assert rmsprop.epsilon == beast_flags.ENV_DEFAULTS["atari"]["epsilon"]


@pytest.mark.parametrize("argv", [["--alpha", "0.9"], ["--momentum", "0.5"]])
def test_rmsprops_own_flags_beside_adam_are_refused(argv):
    parser = common_parser()
    flags = parser.parse_args(["--optimizer", "adam", *argv])
    flags.given = beast_flags.explicit_flags(parser, ["--optimizer", "adam", *argv])
    beast_flags.apply_optimizer_defaults(flags)
    beast_flags.apply_env_defaults(flags, "vector")
    with pytest.raises(beast_flags.FlagError, match=re.escape(
            f"RMSprop's {argv[0]} has no effect with --optimizer adam: leave it out")):
        beast_flags.validate_flags(flags)
    flags.optimizer = "rmsprop"
    beast_flags.validate_flags(flags)
