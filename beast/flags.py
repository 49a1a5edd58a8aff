"""Command-line flags shared by MonoBeast and PolyBeast, and their checks.

Flag names follow TorchBeast where the concept is the same. Flags whose good
value depends on the environment (Atari frames or a small vector) default to
None and are filled in by `apply_env_defaults` once the environment is known;
anything the user passes on the command line always wins.
"""

import argparse
import os

# Defaults chosen per kind of environment. Atari follows TorchBeast (and the
# IMPALA paper's single-machine settings); vector tasks such as CartPole want
# a small MLP, short unrolls, larger batches and a faster learning rate.
ATARI_DEFAULTS = dict(
    model="atari",
    total_steps=50_000_000,
    batch_size=8,
    unroll_length=80,
    learning_rate=0.00048,
    entropy_cost=0.0006,
    reward_clipping="abs_one",
    episodic_life=False,
)
# Chosen with `python -m bench.solve` (2 cores, MonoBeast): CartPole-v1 reached a mean
# return of 475 in 65 of 65 tuning runs and 6 of 8 later checks on a loaded machine
# (two failures: an early collapse, a stall at 318), about 12 s from launch in the median
# on an idle machine; the former settings (T=20, lr 0.008, entropy
# 0.01, 500k steps) missed on 4 of 20. The learning rate decays to 0 over total_steps:
# the late, small steps are what settle the policy, so the schedule must end soon after
# the task is usually solved (1M ends some runs just short of it; constant rates never
# settle). T=80 means fewer learner steps per env step (more SPS, steadier). Seen to
# collapse or stall: lr 0.008 at T=40 (2 seeds of 10), entropy 0.01 at T=80 (1 of 30).
VECTOR_DEFAULTS = dict(
    model="mlp",
    total_steps=1_500_000,
    batch_size=16,
    unroll_length=80,
    learning_rate=0.006,
    entropy_cost=0.005,
    hidden_size=128,
    reward_clipping="none",
    episodic_life=False,
)
# Small images (MinAtar): the MLP settings except for the net, the schedule and the step
# size; unroll_length and entropy_cost keep the values they had before the CartPole tuning.
IMAGE_DEFAULTS = dict(VECTOR_DEFAULTS, model="atari", total_steps=5_000_000,
                      learning_rate=0.00048, unroll_length=20, entropy_cost=0.01)
ATARI_DEFAULTS["hidden_size"] = 128  # Unused by the conv nets; kept for the checkpoint check.


def add_common_flags(parser):
    """Adds every flag that both variants understand to `parser`."""
    # Run and environment.
    parser.add_argument("--env", type=str, default="CartPole-v1",
                        help="Gymnasium environment id, e.g. CartPole-v1, "
                             "ALE/Pong-v5, PongNoFrameskip-v4, MinAtar/Breakout-v1.")
    parser.add_argument("--mode", default="train", choices=["train", "test"],
                        help="Train a model, or load the run's checkpoint and "
                             "play --test_episodes episodes.")
    parser.add_argument("--xpid", default=None,
                        help="Experiment id; a run with an existing id resumes "
                             "from its checkpoint (default: a new time stamp).")
    parser.add_argument("--savedir", default="~/logs/beast",
                        help="Root directory; a run writes to savedir/xpid/.")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seed for the model, the environments and sampling.")
    parser.add_argument("--episodic_life", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="Atari: end training episodes at each life lost "
                             "(the logged return stays the whole game's).")
    parser.add_argument("--env_backend", default="gymnasium",
                        choices=["gymnasium", "envpool"],
                        help="Who steps the environments.")

    # Training length and sizes.
    parser.add_argument("--total_steps", type=int, default=None,
                        help="Environment steps to train for "
                             "(default: 50M on Atari, 1.5M on vector tasks).")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="Rollouts per learner batch (default: 8 Atari, 16 vector).")
    parser.add_argument("--unroll_length", type=int, default=None,
                        help="Steps T per rollout (default: 80 Atari, 20 vector).")
    parser.add_argument("--num_learner_threads", type=int, default=1,
                        help="Learner threads that take batches and update the model.")
    parser.add_argument("--disable_cuda", action="store_true",
                        help="Train on the CPU even when a GPU is present.")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="Learner forward pass precision (V-trace and losses stay fp32).")
    parser.add_argument("--num_torch_threads", type=int, default=None,
                        help="Intra-op threads of the learner process (default: all "
                             "cores; PolyBeast with local servers: cores - num_actors, "
                             "at least 1).")

    # Model.
    parser.add_argument("--model", default=None, choices=["atari", "resnet", "mlp"],
                        help="Network: TorchBeast's Atari net, the IMPALA ResNet, "
                             "or an MLP (default: chosen from the observation).")
    parser.add_argument("--use_lstm", action="store_true",
                        help="Add an LSTM core to the model.")
    parser.add_argument("--hidden_size", type=int, default=None,
                        help="Width of the MLP's hidden layers (default: 128).")

    # Loss.
    parser.add_argument("--entropy_cost", type=float, default=None,
                        help="Entropy cost (default: 0.0006 Atari, 0.01 vector).")
    parser.add_argument("--baseline_cost", type=float, default=0.5,
                        help="Baseline (value) cost.")
    parser.add_argument("--discounting", type=float, default=0.99,
                        help="Discount factor.")
    parser.add_argument("--reward_clipping", default=None, choices=["abs_one", "none"],
                        help="Clip rewards to [-1, 1] for learning "
                             "(default: abs_one on Atari, none elsewhere).")

    # Optimizer (RMSprop, as in TorchBeast).
    parser.add_argument("--learning_rate", type=float, default=None,
                        help="Initial learning rate, decayed linearly to 0 at "
                             "total_steps (default: 0.00048 Atari, 0.006 vector).")
    parser.add_argument("--alpha", type=float, default=0.99,
                        help="RMSprop smoothing constant.")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="RMSprop momentum.")
    parser.add_argument("--epsilon", type=float, default=0.01,
                        help="RMSprop epsilon.")
    parser.add_argument("--grad_norm_clipping", type=float, default=40.0,
                        help="Clip the global gradient norm to this value.")

    # Logging, checkpoints, evaluation.
    parser.add_argument("--log_interval_steps", type=int, default=10_000,
                        help="Write a row of logs.csv every this many environment steps.")
    parser.add_argument("--checkpoint_interval_s", type=float, default=600.0,
                        help="Write a checkpoint every this many seconds "
                             "(and always at the end of a run).")
    parser.add_argument("--eval_interval_steps", type=int, default=0,
                        help="Evaluate the current policy every this many steps on "
                             "separate environments (0: never).")
    parser.add_argument("--eval_episodes", type=int, default=5,
                        help="Episodes per offline evaluation.")
    parser.add_argument("--test_episodes", type=int, default=10,
                        help="Episodes to play in --mode test.")
    parser.add_argument("--no_progress", action="store_true",
                        help="Do not draw the status line.")
    return parser


def apply_env_defaults(flags, info):
    """Fills the flags left at None with the defaults for this environment.

    Args:
      flags: the parsed argparse.Namespace; changed in place.
      info: dict from beast.envs.env_info (observation_shape, is_atari, ...).
    """
    if info["is_atari"]:
        defaults = ATARI_DEFAULTS
    elif len(info["observation_shape"]) == 3:
        defaults = IMAGE_DEFAULTS
    else:
        defaults = VECTOR_DEFAULTS
    for key, value in defaults.items():
        if getattr(flags, key, None) is None:
            setattr(flags, key, value)
    if len(info["observation_shape"]) == 3 and info["observation_shape"][-1] < 40:
        # Small images such as MinAtar's 10x10 do not survive the Atari net's
        # 8x8 stride-4 first layer.
        if flags.model == "atari" and not info["is_atari"]:
            flags.model = "resnet"
    return flags


def validate_flags(flags, extra_problems=()):
    """Checks every flag at once and raises one FlagError listing all problems."""
    problems = list(extra_problems)

    def need(condition, message):
        if not condition:
            problems.append(message)

    need(flags.unroll_length >= 1,
         f"--unroll_length must be at least 1 (got {flags.unroll_length}).")
    need(flags.batch_size >= 1, f"--batch_size must be at least 1 (got {flags.batch_size}).")
    need(flags.total_steps >= 1, f"--total_steps must be positive (got {flags.total_steps}).")
    need(flags.num_learner_threads >= 1,
         f"--num_learner_threads must be at least 1 (got {flags.num_learner_threads}).")
    need(0.0 <= flags.discounting <= 1.0,
         f"--discounting must lie in [0, 1] (got {flags.discounting}).")
    need(flags.learning_rate > 0, f"--learning_rate must be positive (got {flags.learning_rate}).")
    for name in ("entropy_cost", "baseline_cost", "grad_norm_clipping"):
        value = getattr(flags, name)
        need(value >= 0, f"--{name} must not be negative (got {value}).")
    need(flags.hidden_size >= 1, f"--hidden_size must be at least 1 (got {flags.hidden_size}).")
    need(flags.log_interval_steps >= 1,
         f"--log_interval_steps must be at least 1 (got {flags.log_interval_steps}).")
    need(flags.eval_interval_steps >= 0,
         f"--eval_interval_steps must not be negative (got {flags.eval_interval_steps}).")
    need(flags.test_episodes >= 1, f"--test_episodes must be at least 1 (got {flags.test_episodes}).")
    if flags.num_torch_threads is not None:
        need(flags.num_torch_threads >= 1,
             f"--num_torch_threads must be at least 1 (got {flags.num_torch_threads}).")
    if problems:
        raise FlagError(problems)


class FlagError(ValueError):
    """Every problem with the flags, reported together."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(["The flags cannot work together:"]
                                   + [f"  - {p}" for p in self.problems]))


def default_num_torch_threads():
    return max(1, len(os.sched_getaffinity(0)))


def explicit_flags(parser, argv):
    """The names of the flags that the user typed on the command line."""
    shadow = argparse.ArgumentParser(add_help=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            kwargs = dict(dest=action.dest, default=argparse.SUPPRESS)
            if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
                kwargs["action"] = "store_const"
                kwargs["const"] = True
            elif isinstance(action, argparse.BooleanOptionalAction):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["nargs"] = action.nargs
            shadow.add_argument(*action.option_strings, **kwargs)
    given, _ = shadow.parse_known_args(argv)
    return set(vars(given))


def merge_saved_flags(flags, saved, given):
    """On resume or test, flags the user did not type come from the saved run.

    Args:
      flags: the parsed Namespace (changed in place).
      saved: dict of the run's flags.json.
      given: names typed on the command line (they win).
    """
    keep_fresh = {"mode", "xpid", "savedir", "given", "device"}
    for key, value in saved.items():
        if key in given or key in keep_fresh or not hasattr(flags, key):
            continue
        setattr(flags, key, value)
    return flags


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it, or it is None
    ('chosen from the environment') or False (an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)
