"""Command-line flags shared by MonoBeast, PolyBeast and the env servers, and their checks.

Flag names follow TorchBeast where the concept is the same. Flags whose good value depends on the
kind of environment default to None on the command line and are filled in from ENV_DEFAULTS by
`apply_env_defaults` once the environment is known; anything the user passes always wins. Help
strings that state such a default are generated from the table (`describe_defaults`), so they
cannot drift from the values that apply.

The environment flags (`add_env_flags`) are declared once, here, for the learners and for
`python -m polybeast_env`; `env_flag_args` turns a learner's values back into the command line
that starts env servers on the same environment. Env server addresses are parsed here as well.
"""

import argparse
import importlib.util
import os

from beast import machine

# The kinds of environment that choose defaults, as beast.envs.env_info reports them in
# info["kind"], and how help strings name them.
KIND_LABELS = {
    "atari": "Atari",  # ALE games with our preprocessing: uint8 [4, 84, 84]
    "image": "other images",  # any other [C, H, W] observation, e.g. MinAtar's [C, 10, 10]
    "vector": "vector",  # [D] observations, e.g. CartPole's [4]
    "continuous": "continuous control",  # [D] observations and a Box action space: Pendulum
}

# Defaults by kind of environment, for the flags that default to None. Every kind lists every key.
ENV_DEFAULTS = {
    # TorchBeast's settings (the IMPALA paper's single-machine ones).
    "atari": dict(
        model="atari",
        total_steps=50_000_000,
        batch_size=8,
        unroll_length=80,
        learning_rate=0.00048,
        epsilon=0.01,
        entropy_cost=0.0006,
        # TorchBeast's clip: Atari learning with another one has not been measured (the
        # image and vector ones below were).
        grad_norm_clipping=40.0,
        lr_warmup_steps=0,
        pg_clip=0.0,  # IMPALA's loss; the trust region has not been tried on Atari
        # The fc of --model small (the MinAtar paper's 128); the other conv nets ignore it.
        hidden_size=128,
        reward_clipping="abs_one",
        episodic_life=False,
        discounting=0.99,
        reward_scale=1.0,
    ),
    # Written for MinAtar: the vector settings except for the net, the schedule and the step
    # size; unroll_length and entropy_cost keep the values they had before the CartPole tuning.
    # The ResNet, not the Atari net: the Atari net's 8x8 stride-4 first layer needs frames of
    # at least 36 px, and MinAtar's are 10x10. The ResNet (3x3 convolutions, padded
    # poolings) fits frames of any size, so an image env with large frames gets a net that
    # fits as well; it is the IMPALA paper's net for 84x84 frames.
    "image": dict(
        model="resnet",
        total_steps=5_000_000,
        batch_size=16,
        unroll_length=20,
        # Twice TorchBeast's step with RMSprop's epsilon at 0.1 instead of 0.01. RMSprop divides
        # each gradient by the root of that parameter's running mean square plus epsilon, and
        # in a SpaceInvaders checkpoint at 2.5M steps a third of the roots were below 0.01
        # (units gone quiet): with
        # 0.01, such a parameter's first real gradient moves it by up to lr x g / 0.01, and
        # lr 0.00096 alone collapsed SpaceInvaders twice by 2.75M steps. 5M steps, 3 seeds
        # (PolyBeast): SpaceInvaders 186.7 +- 17.5, Seaquest 106.0 +- 3.3, Breakout
        # 162.9 +- 20.4 against 163.7 +- 55.6, 94.7 +- 19.6 (a fall), 148.8 +- 37.8 with
        # 0.00048 and 0.01; Asterix and Freeway level or above (README, "Does it learn?").
        learning_rate=0.00096,
        epsilon=0.1,
        entropy_cost=0.01,
        # A guard against outliers, about 40 per sample of the default batch (T x B = 320):
        # TorchBeast's 40 cut every update (norms 180-1,790 on MinAtar Breakout), which made
        # them all one size, the quiet ones as large as the informative ones. At 2M steps,
        # 3 seeds: Breakout 52.2 +- 18.7 (MonoBeast) and 74.5 +- 22.3 (PolyBeast) against
        # 39.3 +- 22.1 and 38.7 +- 10.2 with 40; SpaceInvaders lost (43.7 +- 2.0 against
        # 51.2 +- 5.6, MonoBeast), the other games were level (README, "Does it learn?").
        grad_norm_clipping=12_800.0,
        lr_warmup_steps=0,
        # PPO's trust region on V-trace's advantages (beast/learner.py, trust_region). Without
        # it, 4 of 5 SpaceInvaders seeds turned deterministic on the way (the policy's entropy
        # below 0.01 nats a step, the return 0 until it came back); with 0.2, no run of the
        # five games did. 5M steps, 3 seeds (PolyBeast): Breakout 185.0 +- 19.5, Seaquest
        # 115.4 +- 5.9, Asterix 39.4 +- 4.7, Freeway 59.4 +- 0.4 against 162.9 +- 20.4,
        # 106.0 +- 3.3, 42.4 +- 2.1, 58.9 +- 0.5, but SpaceInvaders 175.9 +- 40.3 (8 seeds)
        # against 208.9 +- 46.7. The region [0.6, 1.4] keeps the guard (no seed turned
        # deterministic) and gives SpaceInvaders back its pace: 217.0 +- 41.5 over the same 8
        # seeds, 6 at or above the MinAtar paper's best (about 185) against 2; Breakout
        # 232.9 +- 12.3 against 185.0 +- 19.5 (3 seeds; README, "Does it learn?"); Seaquest
        # 109.2 +- 4.7, Asterix 38.8 +- 3.1 and Freeway 59.2 +- 0.5, level with 0.2.
        pg_clip=0.4,
        # The fc of --model small (the MinAtar paper's 128); the other conv nets ignore it.
        hidden_size=128,
        reward_clipping="none",
        episodic_life=False,
        discounting=0.99,
        reward_scale=1.0,
    ),
    # Chosen with `python -m bench.solve` (2 cores, MonoBeast): CartPole-v1 reached a mean
    # return of 475 in 65 of 65 tuning runs; the former settings (T=20, lr 0.008, entropy
    # 0.01, 500k steps) missed on 4 of 20. T=80 means fewer learner steps per env step (more
    # SPS, steadier). Seen to collapse or stall: lr 0.008 at T=40 (2 seeds of 10), entropy
    # 0.01 at T=80 (1 of 30). The learning rate decays to 0 over total_steps: the late, small
    # steps are what settle the policy, so the schedule ends soon after the task is usually
    # solved. Rewards x 0.1 (README, "What a CartPole fall is"): a fall is the cart drifting
    # off the track, and with rewards unscaled (values near 100) the value loss's gradient,
    # which shares the policy's torso and so RMSprop's scale for its steps, weighs 10x more
    # against the policy's (it grows with the square of the scale, the policy's with the
    # scale); baseline_cost 0.05 alone did most of what the scale does. Scaled, with 1M
    # steps, 10 MonoBeast seeds first reached 475 at 0.26M steps in the median (0.88M
    # unscaled, with 1.5M steps) and fell by half 0.6 times a run (3.1). 750k was as good
    # for MonoBeast; 1M leaves PolyBeast room (its slowest of 10 seeds first passed 475 at
    # 0.48M). With the scale, learning rate 0.004 instead of the 0.006 tuned without it: 20
    # MonoBeast seeds fell 5 times in all against 15, as fast (first 475 at 0.24M in the
    # median against 0.26M).
    "vector": dict(
        model="mlp",
        total_steps=1_000_000,
        batch_size=16,
        unroll_length=80,
        learning_rate=0.004,
        epsilon=0.01,
        entropy_cost=0.005,
        # About 40 per sample of T x B = 1,280, as for images: with 40, which cut every update,
        # 2 of 10 CartPole seeds (MonoBeast) ended at 475 or more; with 50,000 and the warm-up,
        # 10 of 10. The warm-up is what the clip did for the first updates: RMSprop's running
        # mean of squared gradients starts at 0, so its first steps are up to 10x the learning
        # rate, and unclipped they turned Acrobot's policy deterministic in 3 of 3 seeds.
        grad_norm_clipping=50_000.0,
        lr_warmup_steps=100_000,
        pg_clip=0.0,  # tuned without it; CartPole's best policy is deterministic anyway
        hidden_size=128,
        reward_clipping="none",
        episodic_life=False,
        discounting=0.99,
        reward_scale=0.1,
    ),
    # Gaussian policies on Box action spaces (beast/models.py), chosen on Pendulum-v1 (2 cores,
    # MonoBeast, 300k steps; tests/test_continuous.py): 14 seeds of 14 passed a mean return of
    # -400 at 80k-150k steps. Short unrolls and small batches: IMPALA makes one update per
    # batch, and T=80 B=16 made an eighth as many (still -1,070 after 300k steps). Rewards
    # times 0.1 keep the values near 1: unscaled (-16 per step at worst), the value loss
    # swamps the shared torso, and the same seed took 230k steps instead of 145k. Discount
    # 0.9: 0.95 learned a little slower and failed on 1 seed of 12, 0.99 had not learned in
    # 300k steps. Locomotion tasks (MuJoCo) usually want 0.99, which bench/learn.py passes
    # for HalfCheetah. The mean is tanh-squashed (beast/models.py): without it, these settings
    # stalled near -1,600, worse than random, as a torque pinned at a bound does.
    "continuous": dict(
        model="mlp",
        total_steps=1_000_000,
        batch_size=8,
        unroll_length=20,
        learning_rate=0.003,
        epsilon=0.01,
        entropy_cost=0.0,
        grad_norm_clipping=40.0,
        lr_warmup_steps=0,
        pg_clip=0.0,  # tuned without it
        hidden_size=64,
        reward_clipping="none",
        episodic_life=False,
        discounting=0.9,
        reward_scale=0.1,
    ),
}


def _format_default(value):
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return repr(value)  # exact: the shortest text that reads back as this float
    return str(value)


def kind_defaults(table, key=None):
    """{kind: value} for every kind of KIND_LABELS, in its order.

    Args:
      table: {kind: {flag: value}} (the shape of ENV_DEFAULTS) when key is given, else
        {kind: value}, e.g. {"atari": 4, "image": 32, "vector": 32}.
      key: a flag name, or None.
    Raises ValueError naming the kinds that the table lacks.
    """
    missing = [kind for kind in KIND_LABELS
               if kind not in table or (key is not None and key not in table[kind])]
    if missing:
        what = f"{key!r} for " if key is not None else ""
        raise ValueError(f"the defaults table has no {what}{', '.join(missing)} "
                         f"(every kind needs one: {', '.join(KIND_LABELS)})")
    return {kind: table[kind] if key is None else table[kind][key] for kind in KIND_LABELS}


def describe_defaults(table, key=None):
    """A per-kind default as help text: "80 Atari, 20 other images, 80 vector", or one value
    ("128") when every kind has the same. Arguments as for kind_defaults."""
    values = kind_defaults(table, key)
    texts = {kind: _format_default(value) for kind, value in values.items()}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return ", ".join(f"{text} {KIND_LABELS[kind]}" for kind, text in texts.items())


def _env_default(key):
    return describe_defaults(ENV_DEFAULTS, key)


def add_env_flags(parser):
    """Adds the flags that decide which environments create_env makes (beast/envs.py). Shared by
    the learners and polybeast_env; see env_flag_args."""
    # Environment.
    parser.add_argument("--env", type=str, default="CartPole-v1",
                        help="Gymnasium environment id, e.g. CartPole-v1, ALE/Pong-v5, "
                             "PongNoFrameskip-v4, MinAtar/Breakout-v1.")
    parser.add_argument("--env_backend", default="gymnasium", choices=["gymnasium", "envpool"],
                        help="Who steps the environments (envpool: Atari ids only).")
    parser.add_argument("--episodic_life", action=argparse.BooleanOptionalAction, default=None,
                        help="Atari: end training episodes at each life lost (the logged return "
                             f"stays the whole game's) (default: {_env_default('episodic_life')}).")
    parser.add_argument("--repeat_action_probability", type=float, default=None,
                        help="Atari sticky actions: the probability that the emulator repeats the "
                             "previous action instead of the chosen one (default: the id's own "
                             "value: 0.25 for ALE/*-v5, 0 for *-v4 such as PongNoFrameskip-v4).")
    return parser


def _env_flag_actions():
    return [action for action in add_env_flags(argparse.ArgumentParser(add_help=False))._actions
            if action.option_strings]


def env_flag_names():
    """The Namespace names (dests) of the flags that add_env_flags declares."""
    return [action.dest for action in _env_flag_actions()]


def env_flag_args(flags):
    """The command-line arguments that give an add_env_flags parser the environment flags'
    values in `flags`, e.g. ["--env=ALE/Pong-v5", "--env_backend=gymnasium",
    "--no-episodic_life"]. A flag at None is left out (the parser's default is None).

    Raises ValueError for a value that the command line cannot express.
    """
    args = []
    for action in _env_flag_actions():
        value = getattr(flags, action.dest)
        option = action.option_strings[0]
        if value is None:
            if action.default is not None:
                raise ValueError(f"{option} is None, which the command line cannot express")
        elif isinstance(action, argparse.BooleanOptionalAction):
            args.append(option if value else action.option_strings[1])
        elif action.nargs is None and action.const is None:
            args.append(f"{option}={value}")  # "=": a value may start with "-"
        else:
            raise ValueError(f"env_flag_args cannot write {option} ({type(action).__name__})")
    return args


def env_flag_problems(flags):
    """The problems with the environment flags' values, as validate_flags lists them."""
    problems = []
    p = getattr(flags, "repeat_action_probability", None)
    if p is not None and not 0.0 <= p <= 1.0:
        problems.append(f"--repeat_action_probability must lie in [0, 1] (got {p}).")
    return problems


def add_common_flags(parser):
    """Adds every flag that both variants understand to `parser`, in groups."""
    add_env_flags(parser)
    _add_run_flags(parser.add_argument_group("run"))
    _add_learner_flags(parser.add_argument_group("learner"))
    _add_loss_flags(parser.add_argument_group("model, loss and optimizer"))
    _add_logging_flags(parser.add_argument_group("logging, checkpoints, evaluation"))
    return parser


def _add_run_flags(group):
    group.add_argument("--mode", default="train", choices=["train", "test"],
                       help="Train a model, or load the run's checkpoint and "
                            "play --test_episodes episodes.")
    group.add_argument("--xpid", default=None,
                       help="Experiment id; a run with an existing id resumes "
                            "from its checkpoint (default: a new time stamp).")
    group.add_argument("--savedir", default="~/logs/beast",
                       help="Root directory; a run writes to savedir/xpid/.")
    group.add_argument("--seed", type=int, default=0,
                       help="Seed for the model, the environments and sampling.")


def _add_learner_flags(group):
    group.add_argument("--total_steps", type=int, default=None,
                       help="Environment steps to train for "
                            f"(default: {_env_default('total_steps')}).")
    group.add_argument("--batch_size", type=int, default=None,
                       help="Rollouts per learner batch "
                            f"(default: {_env_default('batch_size')}).")
    group.add_argument("--unroll_length", type=int, default=None,
                       help=f"Steps T per rollout (default: {_env_default('unroll_length')}).")
    group.add_argument("--num_learner_threads", type=int, default=1,
                       help="Learner threads that take batches and update the model.")
    group.add_argument("--disable_cuda", action="store_true",
                       help="Train on the CPU even when a GPU is present.")
    group.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                       help="Learner forward pass precision (V-trace and losses stay fp32).")
    group.add_argument("--acting_precision", default="fp32", choices=["fp32", "bf16"],
                       help="Precision of the acting model (MonoBeast's actors, PolyBeast's "
                            "inference): bf16 keeps its weights in bfloat16, which halves "
                            "what each small forward pass reads; outputs stay float32, the "
                            "learner float32 (or --precision), and V-trace corrects for "
                            "the difference like any other policy lag. Fast where the CPU "
                            "has bf16 instructions (AMX, AVX-512 BF16), slow where not.")
    group.add_argument("--max_nonfinite_updates", type=int, default=10,
                       help="Learner updates in a row whose loss or gradient is not finite "
                            "(each is skipped, the weights never see it) before the run stops.")
    group.add_argument("--malloc_release", action="store_true",
                       help="On Atari, let glibc hand the memory that each learner step "
                            "frees back to the kernel, as it does by default (and as it "
                            "always does on other tasks). Without it the learner process "
                            "keeps that memory for the next step: a step would otherwise "
                            "fault a few hundred MB in anew (a fifth to a quarter of a Pong "
                            "learner step's CPU on 2 cores).")
    group.add_argument("--num_torch_threads", type=int, default=None,
                       help="Intra-op threads of the learner process (default: all "
                            "cores; PolyBeast with local servers: all cores on Atari, else "
                            "cores - num_actors, at least 1).")


def _add_loss_flags(group):
    group.add_argument("--model", default=None, choices=["atari", "resnet", "small", "mlp"],
                       help="Network: TorchBeast's Atari net, the IMPALA ResNet, the "
                            "MinAtar paper's small conv net (for small frames), or an MLP "
                            f"(default: {_env_default('model')}).")
    group.add_argument("--use_lstm", action="store_true",
                       help="Add an LSTM core to the model.")
    group.add_argument("--hidden_size", type=int, default=None,
                       help="Width of the MLP's hidden layers and of the small net's fc "
                            f"(default: {_env_default('hidden_size')}).")
    group.add_argument("--entropy_cost", type=float, default=None,
                       help=f"Entropy cost (default: {_env_default('entropy_cost')}).")
    group.add_argument("--baseline_cost", type=float, default=0.5,
                       help="Baseline (value) cost.")
    group.add_argument("--pg_clip", type=float, default=None,
                       help="Trust region of the policy gradient: a sample whose probability "
                            "ratio pi/mu has left [1 - pg_clip, 1 + pg_clip] on the side its "
                            "advantage pushes towards adds no gradient (PPO's clip on "
                            "V-trace's advantages); 0: off, IMPALA's loss "
                            f"(default: {_env_default('pg_clip')}).")
    group.add_argument("--discounting", type=float, default=None,
                       help=f"Discount factor (default: {_env_default('discounting')}).")
    group.add_argument("--reward_clipping", default=None, choices=["abs_one", "none"],
                       help="Clip rewards to [-1, 1] for learning "
                            f"(default: {_env_default('reward_clipping')}).")
    group.add_argument("--reward_scale", type=float, default=None,
                       help="Multiply rewards by this for learning, before --reward_clipping; "
                            "the logged returns stay the environment's "
                            f"(default: {_env_default('reward_scale')}).")
    # RMSprop, as in TorchBeast.
    group.add_argument("--learning_rate", type=float, default=None,
                       help="Initial learning rate, decayed linearly to 0 at total_steps "
                            f"(default: {_env_default('learning_rate')}).")
    group.add_argument("--lr_warmup_steps", type=int, default=None,
                       help="Environment steps over which the learning rate rises linearly "
                            "from 0 to --learning_rate before it decays; 0: none "
                            f"(default: {_env_default('lr_warmup_steps')}).")
    group.add_argument("--alpha", type=float, default=0.99,
                       help="RMSprop smoothing constant.")
    group.add_argument("--momentum", type=float, default=0.0,
                       help="RMSprop momentum.")
    group.add_argument("--epsilon", type=float, default=None,
                       help="RMSprop epsilon, added to the root of each parameter's running "
                            "mean square; it bounds the step of a parameter whose gradients "
                            f"were near zero (default: {_env_default('epsilon')}).")
    group.add_argument("--grad_norm_clipping", type=float, default=None,
                       help="Clip the global gradient norm (of the loss summed over T x B) "
                            f"to this value (default: {_env_default('grad_norm_clipping')}).")


def _add_logging_flags(group):
    group.add_argument("--log_interval_steps", type=int, default=10_000,
                       help="Write a row of logs.csv every this many environment steps.")
    group.add_argument("--checkpoint_interval_s", type=float, default=600.0,
                       help="Write a checkpoint every this many seconds "
                            "(and always at the end of a run).")
    group.add_argument("--eval_interval_steps", type=int, default=0,
                       help="Evaluate the current policy every this many steps on "
                            "separate environments (0: never).")
    group.add_argument("--eval_episodes", type=int, default=5,
                       help="Episodes per offline evaluation.")
    group.add_argument("--eval_policy", default="greedy", choices=["greedy", "sample"],
                       help="How offline evaluation and --mode test act: the argmax of the "
                            "policy (as TorchBeast's test mode; a Gaussian policy's mean), or "
                            "actions sampled from it.")
    group.add_argument("--test_episodes", type=int, default=10,
                       help="Episodes to play in --mode test.")
    group.add_argument("--eval_max_steps", type=int, default=100_000,
                       help="Longest evaluation or --mode test game, in environment steps: a "
                            "longer one is stopped and counts with its return so far, with a "
                            "warning (a greedy policy can play some games without end; "
                            "MinAtar's have no time limit). 0: no limit.")
    group.add_argument("--no_progress", action="store_true",
                       help="Do not draw the status line.")
    _add_video_and_wandb_flags(group)


def _add_video_and_wandb_flags(group):
    group.add_argument("--record_video", action="store_true",
                       help="--mode test: write an MP4 of each game's screen (the "
                            "environment's RGB render) to savedir/xpid/videos/.")
    group.add_argument("--eval_video_interval_steps", type=int, default=0,
                       help="Record one offline-evaluation game as an MP4 in savedir/xpid/videos/ "
                            "every this many steps, named by step (0: never).")
    group.add_argument("--wandb_project", default=None,
                       help="Also log to this Weights & Biases project (pip install wandb): "
                            "the logs.csv numbers, the flags, the videos (default: off).")
    group.add_argument("--wandb_entity", default=None,
                       help="W&B entity (user or team) of --wandb_project (default: W&B's own).")
    group.add_argument("--wandb_mode", default=None, choices=["online", "offline"],
                       help="W&B mode; offline writes the run to disk for `wandb sync` "
                            "(default: W&B's own choice, or the WANDB_MODE variable).")


def apply_env_defaults(flags, info, table=ENV_DEFAULTS, names=None):
    """Fills the flags left at None with the defaults of this kind of environment.

    Args:
      flags: the parsed argparse.Namespace; changed in place.
      info: dict from beast.envs.env_info; reads info["kind"] (a key of KIND_LABELS).
      table: {kind: {flag: value}}; ENV_DEFAULTS, or a script's own table of the same shape.
      names: fill only these flags (e.g. env_flag_names() for an env server); None: all of
        the table's.
    Returns flags. Raises ValueError for an unknown kind.
    """
    kind = info["kind"]
    if kind not in KIND_LABELS:
        raise ValueError(f"unknown environment kind {kind!r}; expected one of "
                         f"{', '.join(KIND_LABELS)}")
    for key, value in table[kind].items():
        if (names is None or key in names) and getattr(flags, key, None) is None:
            setattr(flags, key, value)
    return flags


def validate_flags(flags, extra_problems=()):
    """Checks every flag at once and raises one FlagError listing all problems."""
    problems = list(extra_problems) + env_flag_problems(flags)

    def need(condition, message):
        if not condition:
            problems.append(message)

    need(flags.unroll_length >= 1,
         f"--unroll_length must be at least 1 (got {flags.unroll_length}).")
    need(flags.batch_size >= 1, f"--batch_size must be at least 1 (got {flags.batch_size}).")
    need(flags.lr_warmup_steps >= 0,
         f"--lr_warmup_steps must not be negative (got {flags.lr_warmup_steps}).")
    need(flags.max_nonfinite_updates >= 1,
         f"--max_nonfinite_updates must be at least 1 (got {flags.max_nonfinite_updates}).")
    need(flags.total_steps >= 1, f"--total_steps must be positive (got {flags.total_steps}).")
    need(flags.num_learner_threads >= 1,
         f"--num_learner_threads must be at least 1 (got {flags.num_learner_threads}).")
    # MonoBeast's --deterministic: with several threads, timing would order the updates.
    need(not getattr(flags, "deterministic", False) or flags.num_learner_threads == 1,
         "--deterministic learns in one thread: drop --num_learner_threads "
         f"(got {flags.num_learner_threads}) or set it to 1.")
    need(0.0 <= flags.discounting <= 1.0,
         f"--discounting must lie in [0, 1] (got {flags.discounting}).")
    need(flags.reward_scale > 0, f"--reward_scale must be positive (got {flags.reward_scale}).")
    need(flags.learning_rate > 0, f"--learning_rate must be positive (got {flags.learning_rate}).")
    for name in ("entropy_cost", "baseline_cost", "grad_norm_clipping"):
        value = getattr(flags, name)
        need(value >= 0, f"--{name} must not be negative (got {value}).")
    need(flags.hidden_size >= 1, f"--hidden_size must be at least 1 (got {flags.hidden_size}).")
    need(flags.log_interval_steps >= 1,
         f"--log_interval_steps must be at least 1 (got {flags.log_interval_steps}).")
    need(flags.eval_interval_steps >= 0,
         f"--eval_interval_steps must not be negative (got {flags.eval_interval_steps}).")
    need(flags.pg_clip >= 0, f"--pg_clip must not be negative (got {flags.pg_clip}).")
    need(flags.eval_max_steps >= 0,
         f"--eval_max_steps must not be negative (got {flags.eval_max_steps}).")
    need(flags.test_episodes >= 1, f"--test_episodes must be at least 1 (got {flags.test_episodes}).")
    if flags.num_torch_threads is not None:
        need(flags.num_torch_threads >= 1,
             f"--num_torch_threads must be at least 1 (got {flags.num_torch_threads}).")
    problems += video_and_wandb_problems(flags)
    if problems:
        raise FlagError(problems)


def video_and_wandb_problems(flags):
    """The problems with the video and W&B flags that need no environment (beast/video.py
    checks that the environment renders)."""
    problems = []
    interval = flags.eval_video_interval_steps
    if interval < 0:
        problems.append(f"--eval_video_interval_steps must not be negative (got {interval}).")
    if flags.record_video and flags.mode != "test":
        problems.append("--record_video records the games of --mode test; while training, "
                        "record evaluation games with --eval_video_interval_steps N.")
    videos = flags.record_video or interval > 0
    missing = [p for p, module in (("imageio", "imageio"), ("imageio-ffmpeg", "imageio_ffmpeg"))
               if importlib.util.find_spec(module) is None]
    if videos and missing:
        problems.append(f"videos need the package(s) {', '.join(missing)}: "
                        f"pip install {' '.join(missing)}")
    if flags.wandb_project is None:
        for name in ("wandb_entity", "wandb_mode"):
            if getattr(flags, name) is not None:
                problems.append(f"--{name} needs --wandb_project.")
    elif importlib.util.find_spec("wandb") is None:  # find_spec: W&B is not imported here
        problems.append("--wandb_project needs the Weights & Biases package: pip install wandb")
    return problems


class FlagError(ValueError):
    """Every problem with the flags, reported together."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(["The flags cannot work together:"]
                                   + [f"  - {p}" for p in self.problems]))


def default_num_torch_threads():
    return max(1, machine.cores())


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
    keep_fresh = {"mode", "xpid", "savedir", "given"}
    for key, value in saved.items():
        if key in given or key in keep_fresh or not hasattr(flags, key):
            continue
        setattr(flags, key, value)
    for key, value in BEFORE_THE_FLAG.items():
        if key not in saved and key not in given:
            setattr(flags, key, value)
    return flags


# Flags that changed what a run does by default after runs were saved without them, and the
# value that keeps such a run doing what it did: a resume must not change its loss midway.
BEFORE_THE_FLAG = {"pg_clip": 0.0}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it, or it is None
    ('chosen from the environment') or False (an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        # "is", not "in (...)": 0 == False, and a default of 0 is worth showing.
        if ("default" in text or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


# ---------------------------------------------------------------------------------------------
# Env server addresses: "unix:PATH" (this machine only) or "HOST:PORT" / "tcp:HOST:PORT" (TCP).

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def split_host_port(address):
    """"tcp:HOST:PORT" or "HOST:PORT" -> (HOST, PORT as int); an IPv6 HOST is written [::1].
    Raises ValueError for anything else, unix:PATH included."""
    text = address[len("tcp:"):] if address.startswith("tcp:") else address
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected a TCP address HOST:PORT, got {address!r}")
    return host, int(port)


# Env server addresses that are a unix socket file: "unix:" is gRPC over it, "raw:" our
# framing without gRPC (csrc/raw_socket.h), which only our servers and learner speak.
SOCKET_SCHEMES = ("unix:", "raw:")


# A unix socket's path is held in sockaddr_un.sun_path: 108 bytes on Linux, one of them the
# final NUL. A longer path fails deep in gRPC or the raw transport; we say so up front.
MAX_SOCKET_PATH_BYTES = 107


def socket_path(address):
    """The socket file of a unix:PATH or raw:PATH address; None for any other address."""
    for scheme in SOCKET_SCHEMES:
        if address.startswith(scheme):
            return address[len(scheme):]
    return None


def socket_path_problem(address):
    """What makes a unix:PATH or raw:PATH address unusable (no path, or one longer than a unix
    socket can hold), as a sentence; None when it is fine or not a socket address."""
    path = socket_path(address)
    if path is None:
        return None
    if not path:
        return f"{address!r} names no socket path: give {address}PATH"
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        return (f"the socket path of {address!r} is {size} bytes, and a unix socket's path "
                f"holds at most {MAX_SOCKET_PATH_BYTES}: choose a shorter directory")
    return None


def is_loopback(address):
    """Whether only this machine can reach `address` (unix:PATH, raw:PATH, or a loopback
    HOST:PORT). Raises ValueError for an address that is none of these."""
    if socket_path(address) is not None:
        return True
    host, _ = split_host_port(address)
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def parse_address_list(text):
    """A comma-separated --server_addresses value -> a list of addresses: "unix:PATH" and
    "raw:PATH" as given, "HOST:PORT" with a "tcp:" prefix dropped. Blank entries (a trailing comma) are
    skipped. Raises ValueError naming the first bad entry, or for a list with no address."""
    addresses = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if socket_path(entry) is not None:
            problem = socket_path_problem(entry)
            if problem:
                raise ValueError(problem)
            addresses.append(entry)
            continue
        try:
            host, port = split_host_port(entry)
        except ValueError:
            raise ValueError(f"{entry!r} is neither unix:PATH, raw:PATH nor HOST:PORT") from None
        addresses.append(f"{host}:{port}")
    if not addresses:
        raise ValueError(f"no address in {text!r}: give unix:PATH or HOST:PORT, comma-separated")
    return addresses
