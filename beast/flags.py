"""Command-line flags shared by MonoBeast, PolyBeast and the env servers, and their checks.

Flag names follow TorchBeast where the concept is the same. Flags whose good value depends on the
kind of environment default to None on the command line and are filled in from ENV_DEFAULTS by
`apply_env_defaults` once the environment is known; anything the user passes always wins. Help
strings that state such a default are generated from the table (`describe_defaults`), so they
cannot drift from the values that apply.

The environment flags (`add_env_flags`) are declared once, here, for the learners and for
`python -m polybeast_env`; `env_flag_args` turns a learner's values back into the command line
that starts env servers on the same environment.
"""

import argparse
import functools
import importlib.util
import math

from beast import machine

# The kinds of environment that choose defaults, as beast.envs.env_info reports them in
# info["kind"], and how help strings name them.
KIND_LABELS = {
    "atari": "Atari",  # ALE games with our preprocessing: uint8 [4, 84, 84]
    "sticky_atari": "sticky Atari",  # the same with sticky actions (repeat_action_probability > 0)
    "image": "other images",  # any other [C, H, W] observation, e.g. MinAtar's [C, 10, 10]
    "vector": "vector",  # [D] observations, e.g. CartPole's [4]
    "continuous": "continuous control",  # [D] observations and a Box action space: Pendulum
    "nethack": "NetHack",  # the NetHack Learning Environment's glyphs and blstats (the nle package)
}

PRECISIONS = ["auto", "fp32", "bf16"]

# Adam's epsilon is the one CleanRL's and Cleanba's Atari PPO give it; the per-kind
# epsilons of ENV_DEFAULTS are RMSprop's.
ADAM_EPSILON = 1e-5
RMSPROP_ONLY_FLAGS = ("alpha", "momentum")

# TorchBeast's settings, but for the orthogonal init and batches of 4 x 20 steps.
ATARI_DEFAULTS = dict(
    model="atari",
    init="orthogonal",
    total_steps=50_000_000,
    batch_size=4,
    unroll_length=20,
    learning_rate=0.00048,
    epsilon=0.01,
    entropy_cost=0.0006,
    grad_norm_clipping=40.0,
    lr_warmup_steps=0,
    pg_clip=0.0,
    hidden_size=128,
    channels=[16, 32, 32],
    reward_clipping="abs_one",
    episodic_life=False,
    discounting=0.99,
    reward_scale=1.0,
    normalize_rewards=False,
    precision="auto",
    acting_precision="auto",
)

# Defaults by kind of environment, for the flags that default to None; every kind lists every
# key. Why each value is what it is, with the runs that chose it: docs/defaults.md.
ENV_DEFAULTS = {
    "atari": ATARI_DEFAULTS,
    # The Atari settings with the IMPALA ResNet at half its width, batches of 8, a trust
    # region and the references' entropy cost: with sticky actions they learn more per step
    # and per minute than the Atari net, and the policy stays spread instead of collapsing.
    "sticky_atari": dict(ATARI_DEFAULTS, model="resnet", channels=[8, 16, 16], batch_size=8,
                         pg_clip=0.4, entropy_cost=0.01),
    # MinAtar's: the IMPALA ResNet (it fits frames of any size), a trust region.
    "image": dict(
        model="resnet",
        init="torch",
        total_steps=5_000_000,
        batch_size=16,
        unroll_length=20,
        learning_rate=0.00096,
        epsilon=0.1,
        entropy_cost=0.01,
        grad_norm_clipping=12_800.0,
        lr_warmup_steps=0,
        pg_clip=0.4,
        hidden_size=128,
        channels=[16, 32, 32],
        reward_clipping="none",
        episodic_life=False,
        discounting=0.99,
        reward_scale=1.0,
        normalize_rewards=False,
        precision="fp32",
        acting_precision="fp32",
    ),
    # CartPole's, chosen with `python -m bench.solve`: T=80, rewards x 0.1, a warm-up.
    "vector": dict(
        model="mlp",
        init="torch",
        total_steps=1_000_000,
        batch_size=16,
        unroll_length=80,
        learning_rate=0.004,
        epsilon=0.01,
        entropy_cost=0.005,
        grad_norm_clipping=50_000.0,
        lr_warmup_steps=100_000,
        pg_clip=0.0,
        hidden_size=128,
        channels=[16, 32, 32],
        reward_clipping="none",
        episodic_life=False,
        discounting=0.99,
        reward_scale=0.1,
        normalize_rewards=False,
        precision="fp32",
        acting_precision="fp32",
    ),
    # Gaussian policies on Box action spaces, chosen on Pendulum-v1.
    "continuous": dict(
        model="mlp",
        init="torch",
        total_steps=1_000_000,
        batch_size=8,
        unroll_length=20,
        learning_rate=0.003,
        epsilon=0.01,
        entropy_cost=0.0,
        grad_norm_clipping=40.0,
        lr_warmup_steps=0,
        pg_clip=0.0,
        hidden_size=64,
        channels=[16, 32, 32],
        reward_clipping="none",
        episodic_life=False,
        discounting=0.9,
        reward_scale=0.1,
        normalize_rewards=False,
        precision="fp32",
        acting_precision="fp32",
    ),
    # The NLE paper's IMPALA (T=80, lr 2e-4, RMSprop epsilon 1e-6, entropy 0.001, discount
    # 0.999) at a quarter of its batch, the score's jumps scaled and clipped, and the guards
    # of the other kinds (warm-up, trust region); not yet tuned on NetHack.
    "nethack": dict(
        model="nethack",
        init="orthogonal",
        total_steps=50_000_000,
        batch_size=8,
        unroll_length=80,
        learning_rate=0.0002,
        epsilon=0.000001,
        entropy_cost=0.001,
        grad_norm_clipping=25_600.0,
        lr_warmup_steps=100_000,
        pg_clip=0.4,
        hidden_size=256,
        channels=[16, 32, 32],
        reward_clipping="abs_one",
        episodic_life=False,
        discounting=0.999,
        reward_scale=0.1,
        normalize_rewards=False,
        precision="fp32",
        acting_precision="fp32",
    ),
}


def _format_default(value):
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return repr(value)  # exact: the shortest text that reads back as this float
    if isinstance(value, list):
        return ",".join(map(str, value))  # as --channels takes it
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


# ---------------------------------------------------------------------------------------------
# Numeric flags: each declares its range where it is declared, as its argparse type, e.g.
# type=Number(int, low=1). validate_flags (range_problems) checks every numeric flag against it,
# whether the value was typed, taken from a resumed run's flags.json or filled in from
# ENV_DEFAULTS, and reports all of them at once.


class Number:
    """The argparse type of a numeric flag, and its range.

    Args:
      kind: int or float.
      low, high: inclusive bounds (None: unbounded).
      above, below: exclusive bounds (None: unbounded).
      infinite: whether inf (or -inf, where the bounds allow it) is a meaningful value, which
        the flag's help then explains; NaN never is.
    Called by argparse, it only converts the text, so that every problem is reported together
    by validate_flags; a default of None (chosen later, or "off") is never checked.
    """

    def __init__(self, kind, low=None, high=None, *, above=None, below=None, infinite=False):
        if kind not in (int, float):
            raise ValueError(f"Number takes int or float, not {kind!r}")
        self.kind = kind
        self.low, self.high, self.above, self.below = low, high, above, below
        self.infinite = infinite
        self.__name__ = kind.__name__  # argparse's "invalid float value: 'x'" names it

    def __call__(self, text):
        return self.kind(text)

    def __repr__(self):
        return f"Number({self.describe()})"

    def _key(self):
        return (self.kind, self.low, self.high, self.above, self.below, self.infinite)

    def __eq__(self, other):  # the same range declared twice is the same type
        return isinstance(other, Number) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def describe(self):
        """What the flag takes, e.g. "an integer >= 1", "a finite number in [0, 1)" or
        "a finite number > 0 or inf"."""
        noun = "an integer" if self.kind is int else "a finite number"
        lower = (f"[{self.low}" if self.low is not None else
                 f"({self.above}" if self.above is not None else None)
        upper = (f"{self.high}]" if self.high is not None else
                 f"{self.below})" if self.below is not None else None)
        if lower and upper:
            text = f"{noun} in {lower}, {upper}"
        elif lower:
            text = f"{noun} {'>=' if lower[0] == '[' else '>'} {lower[1:]}"
        elif upper:
            text = f"{noun} {'<=' if upper[-1] == ']' else '<'} {upper[:-1]}"
        else:
            text = noun
        return text + " or inf" if self.infinite else text

    def fits(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if math.isnan(value) or (math.isinf(value) and not self.infinite):
            return False
        return ((self.low is None or value >= self.low) and
                (self.high is None or value <= self.high) and
                (self.above is None or value > self.above) and
                (self.below is None or value < self.below))


def channel_list(text):
    """--channels: "16,32,32" as [16, 32, 32] (a list, as flags.json reads it back)."""
    try:
        channels = [int(part) for part in text.split(",")]
    except ValueError:
        channels = []
    if not channels or min(channels) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers >= 1, e.g. 16,32,32")
    return channels


def numeric_actions(parser):
    """The actions of `parser`'s numeric flags (those whose type is a Number)."""
    return [action for action in parser._actions if isinstance(action.type, Number)]


def range_problems(flags, parser):
    """One problem for each numeric flag of `parser` whose value in `flags` is out of its range
    (not finite, or beyond a bound): it names the flag, the value and what the flag takes."""
    problems = []
    for action in numeric_actions(parser):
        value = getattr(flags, action.dest)
        if value is None and action.default is None:
            continue
        if not action.type.fits(value):
            problems.append(f"{action.option_strings[0]} must be {action.type.describe()} "
                            f"(got {value!r}).")
    return problems


def add_env_flags(parser, group=None):
    """Adds the flags that decide which environments create_env makes (beast/envs.py). Shared by
    the learners and polybeast_env; see env_flag_args. --env goes to `parser`, the others to
    `group` (an argument group of it; default: parser too)."""
    parser.add_argument("--env", type=str, default="CartPole-v1",
                        help="Gymnasium environment id, e.g. CartPole-v1, ALE/Pong-v5, "
                             "PongNoFrameskip-v4, MinAtar/Breakout-v1, NetHackScore-v0.")
    group = parser if group is None else group
    group.add_argument("--env_backend", default="gymnasium", choices=["gymnasium", "envpool"],
                       help="Who steps the environments (envpool: Atari ids only).")
    group.add_argument("--episodic_life", action=argparse.BooleanOptionalAction, default=None,
                       help="Atari: end training episodes at each life lost (the logged return "
                            f"stays the whole game's) (default: {_env_default('episodic_life')}).")
    group.add_argument("--repeat_action_probability", type=Number(float, 0, 1), default=None,
                       help="Atari sticky actions: the probability that the emulator repeats the "
                            "previous action instead of the chosen one (default: the id's own "
                            "value: 0.25 for ALE/*-v5, 0 for *-v4 such as PongNoFrameskip-v4).")
    group.add_argument("--full_action_space", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="Atari: act with all 18 joystick actions instead of the game's "
                            "minimal set, as the Machado et al. (2018) protocol does (default: "
                            "the id's own set, the minimal one for ALE/*-v5 and *-v4).")
    group.add_argument("--noop_max", type=Number(int, 0), default=None,
                       help="Atari: start each game with 1 to noop_max no-op frames, drawn at "
                            "random; 0: none, as the Machado et al. (2018) protocol has "
                            "(default: 30, as DeepMind's and TorchBeast's preprocessing).")
    group.add_argument("--penalty_step", type=Number(float, None, 0), default=None,
                       help="NetHack: the reward of a step on which the game's clock stands "
                            "still (a menu, a prompt, a move into a wall), NLE's penalty_step "
                            "(default: the NLE paper's: -0.001, and -0.00001 on the tasks that "
                            "pay 1 for a success, Staircase, StaircasePet and Oracle; "
                            "NetHackChallenge-v0 keeps NLE's 0; NLE registers -0.01 for the "
                            "others).")
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


def add_common_flags(parser):
    """Adds every flag that both variants understand to `parser`, in argument groups created
    in the order --help shows them: first the flags a TorchBeast user knows, then the rest by
    topic, the operations last. Returns the groups (an argparse.Namespace: torchbeast,
    environment, run, model, logging, operations), where a variant adds its own flags."""
    groups = argparse.Namespace(
        torchbeast=parser.add_argument_group("TorchBeast's flags"),
        environment=parser.add_argument_group("environment"),
        run=parser.add_argument_group("run"),
        model=parser.add_argument_group("model, loss and optimizer"),
        logging=parser.add_argument_group("logging, checkpoints, evaluation"),
        operations=parser.add_argument_group(
            "operations (threads, timeouts, processes, limits)"))
    add_env_flags(groups.torchbeast, groups.environment)
    _add_run_flags(groups)
    _add_learner_flags(groups)
    _add_loss_flags(groups)
    _add_optimizer_flags(groups)
    _add_logging_flags(groups.logging)
    return groups


def _add_run_flags(groups):
    group = groups.torchbeast
    group.add_argument("--mode", default="train", choices=["train", "test"],
                       help="Train a model, or load the run's checkpoint and "
                            "play --test_episodes episodes.")
    group.add_argument("--xpid", default=None,
                       help="Experiment id; a run with an existing id resumes from its "
                            "checkpoint, with its saved flags where none is typed. A typed "
                            "flag takes effect (the optimizer's included), except those that "
                            "fix the environment and the network, which are refused "
                            "(default: a new time stamp).")
    group.add_argument("--savedir", default="~/logs/beast",
                       help="Root directory; a run writes to savedir/xpid/.")
    groups.run.add_argument("--seed", type=Number(int, low=0), default=0,
                            help="Seed for the model, the environments and sampling.")


def _add_learner_flags(groups):
    group = groups.torchbeast
    group.add_argument("--total_steps", type=Number(int, low=1), default=None,
                       help="Environment steps to train for; the learning rate decays "
                            "linearly to 0 here. The schedule is a function of the step and "
                            "this total, so a resume with a longer one continues at the rate "
                            "the new total gives at the current step (higher than before) "
                            f"and decays from there (default: {_env_default('total_steps')}).")
    group.add_argument("--batch_size", type=Number(int, low=1), default=None,
                       help="Rollouts per learner batch, 8 on Atari on a GPU machine (a "
                            "CUDA learner with at least "
                            f"{machine.GPU_MACHINE_MIN_CORES} cores) "
                            f"(default: {_env_default('batch_size')}).")
    group.add_argument("--unroll_length", type=Number(int, low=1), default=None,
                       help=f"Steps T per rollout (default: {_env_default('unroll_length')}).")
    group.add_argument("--num_learner_threads", type=Number(int, low=1), default=None,
                       help="Learner threads that take batches and update the model "
                            "(default: 1; 2 on a GPU machine, a CUDA learner with at least "
                            f"{machine.GPU_MACHINE_MIN_CORES} cores).")
    group.add_argument("--disable_cuda", action="store_true",
                       help="Train on the CPU even when a GPU is present.")
    group = groups.run
    group.add_argument("--precision", default=None, choices=PRECISIONS,
                       help="Learner forward pass precision (V-trace and losses stay fp32); "
                            "auto: bf16 where the learner runs on a CPU with bf16 "
                            "instructions (AMX, AVX-512 BF16), else fp32. The run's meta.json "
                            "and status line say which "
                            f"(default: {_env_default('precision')}).")
    group.add_argument("--acting_precision", default=None, choices=PRECISIONS,
                       help="Precision of the acting model (MonoBeast's actors, PolyBeast's "
                            "inference): bf16 keeps its weights in bfloat16, which halves "
                            "what each small forward pass reads; outputs stay float32, the "
                            "learner float32 (or --precision), and V-trace corrects for "
                            "the difference like any other policy lag. Fast where the CPU "
                            "has bf16 instructions (AMX, AVX-512 BF16), slow where not; auto "
                            "as for --precision "
                            f"(default: {_env_default('acting_precision')}).")
    group = groups.operations
    group.add_argument("--max_nonfinite_updates", type=Number(int, low=1), default=10,
                       help="Learner updates in a row whose loss or gradient is not finite "
                            "(each is skipped, the weights never see it) before the run stops.")
    group.add_argument("--num_torch_threads", type=Number(int, low=1), default=None,
                       help="Intra-op threads of the learner process (default: the "
                            "cores the actors leave, cores - num_actors, at least 1, in "
                            "MonoBeast and in PolyBeast with local servers; else all cores).")


def _add_loss_flags(groups):
    group, torchbeast = groups.model, groups.torchbeast
    # Imported here, not at the top: env servers import this module and start without torch.
    from beast import models

    networks = "; ".join(f"{name}: {(net.__doc__ or net.__name__).splitlines()[0].rstrip('.')}"
                         for name, net in models.MODELS.items())
    group.add_argument("--model", default=None, choices=list(models.MODELS),
                       help=f"Network, one of beast/models.py MODELS ({networks}) "
                            f"(default: {_env_default('model')}).")
    group.add_argument("--init", default=None, choices=["torch", "orthogonal"],
                       help="Initial weights: PyTorch's default, or orthogonal weights and "
                            "zero biases as OpenAI's baselines draw them, see "
                            "beast/models.py init_orthogonal "
                            f"(default: {_env_default('init')}).")
    torchbeast.add_argument("--use_lstm", action="store_true",
                            help="Add an LSTM core to the model.")
    group.add_argument("--hidden_size", type=Number(int, low=1), default=None,
                       help="Width of the MLP's hidden layers, of the small net's fc, of "
                            "DictNet's encoders and of the NetHack net's features "
                            f"(default: {_env_default('hidden_size')}).")
    group.add_argument("--channels", type=channel_list, default=None,
                       help="Channels of the ResNet's sections, comma-separated, one number "
                            "a section (each halves the frame): its cost on a CPU grows with "
                            f"them (default: {_env_default('channels')}).")
    torchbeast.add_argument("--entropy_cost", type=Number(float, low=0), default=None,
                            help=f"Entropy cost (default: {_env_default('entropy_cost')}).")
    torchbeast.add_argument("--baseline_cost", type=Number(float, low=0), default=0.5,
                            help="Baseline (value) cost.")
    group.add_argument("--pg_clip", type=Number(float, low=0), default=None,
                       help="Trust region of the policy gradient: a sample whose probability "
                            "ratio pi/mu has left [1 - pg_clip, 1 + pg_clip] on the side its "
                            "advantage pushes towards adds no gradient (PPO's clip on "
                            "V-trace's advantages); 0: off, IMPALA's loss "
                            f"(default: {_env_default('pg_clip')}).")
    group.add_argument("--normalize_advantages", default="none",
                       choices=["none", "mean", "mean_std"],
                       help="Normalize the policy gradient's V-trace advantages over each "
                            "batch: mean takes the batch's mean out (common to every action "
                            "taken, it tells none apart), mean_std also divides by their "
                            "standard deviation, as PPO does.")
    torchbeast.add_argument("--discounting", type=Number(float, 0, 1), default=None,
                            help=f"Discount factor (default: {_env_default('discounting')}).")
    torchbeast.add_argument("--reward_clipping", default=None, choices=["abs_one", "none"],
                            help="Clip rewards to [-1, 1] for learning "
                                 f"(default: {_env_default('reward_clipping')}).")
    group.add_argument("--reward_scale", type=Number(float, above=0), default=None,
                       help="Multiply rewards by this for learning, before --reward_clipping; "
                            "the logged returns stay the environment's "
                            f"(default: {_env_default('reward_scale')}).")
    group.add_argument("--normalize_rewards", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="Divide rewards for learning by the standard deviation of every "
                            "reward the learner has seen so far, as the NLE paper's baseline "
                            "does, before --reward_scale and --reward_clipping; the logged "
                            "returns stay the environment's (default: "
                            f"{_env_default('normalize_rewards')}).")


def _add_optimizer_flags(groups):
    # RMSprop, as in TorchBeast, or Adam.
    group, torchbeast = groups.model, groups.torchbeast
    # Imported here, not at the top: env servers import this module and start without torch.
    from beast import learner
    torchbeast.add_argument("--learning_rate", type=Number(float, above=0), default=None,
                            help="Initial learning rate, decayed linearly to 0 at total_steps "
                                 f"(default: {_env_default('learning_rate')}).")
    group.add_argument("--lr_warmup_steps", type=Number(int, low=0), default=None,
                       help="Environment steps over which the learning rate rises linearly "
                            "from 0 to --learning_rate before it decays; 0: none "
                            f"(default: {_env_default('lr_warmup_steps')}).")
    group.add_argument("--optimizer", choices=list(learner.OPTIMIZERS), default="rmsprop",
                       help="rmsprop: TorchBeast's (--alpha, --momentum, --epsilon); adam: "
                            "Adam with betas 0.9 and 0.999 and --epsilon, which then defaults "
                            f"to {ADAM_EPSILON:g}.")
    torchbeast.add_argument("--alpha", type=Number(float, 0, 1), default=0.99,
                            help="RMSprop smoothing constant.")
    torchbeast.add_argument("--momentum", type=Number(float, low=0, below=1), default=0.0,
                            help="RMSprop momentum.")
    torchbeast.add_argument("--epsilon", type=Number(float, above=0), default=None,
                            help="RMSprop's (or Adam's) epsilon, added to the root of each "
                                 "parameter's running mean square; it bounds the step of a "
                                 "parameter whose gradients were near zero; Adam's is "
                                 f"{ADAM_EPSILON:g} unless typed (default: "
                                 f"{_env_default('epsilon')}).")
    group.add_argument("--epochs", type=Number(int, low=1), default=1,
                       help="Updates per batch: the learner passes over each batch this many "
                            "times, V-trace recomputed under its weights of the moment, as "
                            "PPO's epochs reuse a batch; pair it with --pg_clip, which keeps "
                            "the later passes from carrying the policy far from the one that "
                            "acted; 1: IMPALA's one pass.")
    torchbeast.add_argument("--grad_norm_clipping", type=Number(float, above=0, infinite=True),
                            default=None,
                            help="Clip the global gradient norm (of the loss summed over T x B) "
                                 "to this value; inf: no clipping "
                                 f"(default: {_env_default('grad_norm_clipping')}).")


def _add_logging_flags(group):
    group.add_argument("--log_interval_steps", type=Number(int, low=1), default=10_000,
                       help="Write a row of logs.csv every this many environment steps.")
    group.add_argument("--checkpoint_interval_s", type=Number(float, low=0, infinite=True),
                       default=600.0,
                       help="Write a checkpoint every this many seconds "
                            "(and always at the end of a run; inf: only then).")
    group.add_argument("--eval_interval_steps", type=Number(int, low=0), default=0,
                       help="Evaluate the current policy every this many steps on "
                            "separate environments (0: never).")
    group.add_argument("--eval_episodes", type=Number(int, low=1), default=5,
                       help="Episodes per offline evaluation (to evaluate never, leave "
                            "--eval_interval_steps at 0).")
    group.add_argument("--eval_envs", type=Number(int, low=1), default=8,
                       help="Environments that offline evaluation and --mode test play at "
                            "once, one forward pass for all; each plays a share of the games "
                            "fixed before any starts, so short games are not favoured.")
    group.add_argument("--eval_policy", default="greedy", choices=["greedy", "sample"],
                       help="How offline evaluation and --mode test act: the argmax of the "
                            "policy (as TorchBeast's test mode; a Gaussian policy's mean), or "
                            "actions sampled from it.")
    group.add_argument("--test_episodes", type=Number(int, low=1), default=10,
                       help="Episodes to play in --mode test.")
    group.add_argument("--eval_max_steps", type=Number(int, low=0), default=100_000,
                       help="Longest evaluation or --mode test game, in environment steps: a "
                            "longer one is stopped and counts with its return so far, with a "
                            "warning (a greedy policy can play some games without end; "
                            "MinAtar's have no time limit). 0: no limit.")
    group.add_argument("--no_progress", action="store_true",
                       help="Do not draw the status line (training's, or --mode test's games so "
                            "far).")
    _add_video_and_wandb_flags(group)


def _add_video_and_wandb_flags(group):
    group.add_argument("--record_video", action="store_true",
                       help="--mode test: write an MP4 of each game's screen (the "
                            "environment's RGB render) to savedir/xpid/videos/.")
    group.add_argument("--eval_video_interval_steps", type=Number(int, low=0), default=0,
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


# What a GPU machine (machine.is_gpu_machine) changes in ENV_DEFAULTS: on Atari, batches of 8,
# as in the layout measured there (docs/performance.md "What changes with the machine").
GPU_MACHINE_DEFAULTS = {"atari": dict(batch_size=8)}


def apply_machine_defaults(flags, kind, gpu_machine):
    """Fills the flags left at None that a GPU machine sets otherwise (GPU_MACHINE_DEFAULTS,
    then num_learner_threads: 2 there, else 1, and 1 with --deterministic, which learns in
    one thread); call it before apply_env_defaults."""
    if gpu_machine:
        for key, value in GPU_MACHINE_DEFAULTS.get(kind, {}).items():
            if getattr(flags, key) is None:
                setattr(flags, key, value)
    if flags.num_learner_threads is None:
        one_thread = getattr(flags, "deterministic", False)
        flags.num_learner_threads = 2 if gpu_machine and not one_thread else 1
    return flags


def apply_optimizer_defaults(flags):
    """Fills --epsilon with Adam's default when --optimizer adam left it at None; call it before
    apply_env_defaults, whose epsilons are RMSprop's."""
    if getattr(flags, "optimizer", "rmsprop") == "adam" and flags.epsilon is None:
        flags.epsilon = ADAM_EPSILON
    return flags


def optimizer_problems(flags):
    """RMSprop's own flags typed beside --optimizer adam, which would have no effect."""
    typed = [f"--{name}" for name in RMSPROP_ONLY_FLAGS if name in getattr(flags, "given", ())]
    if getattr(flags, "optimizer", "rmsprop") == "adam" and typed:
        verb, pronoun = ("has", "it") if len(typed) == 1 else ("have", "them")
        return [f"RMSprop's {' and '.join(typed)} {verb} no effect with --optimizer adam: "
                f"leave {pronoun} out, or use --optimizer rmsprop."]
    return []


def apply_env_defaults(flags, kind, table=ENV_DEFAULTS, names=None):
    """Fills the flags left at None with the defaults of this kind of environment.

    Args:
      flags: the parsed argparse.Namespace; changed in place.
      kind: the kind of environment (beast.envs.env_info's "kind", a key of KIND_LABELS).
      table: {kind: {flag: value}}; ENV_DEFAULTS, or a script's own table of the same shape.
      names: fill only these flags (e.g. env_flag_names() for an env server); None: all of
        the table's.
    Returns flags. Raises ValueError for an unknown kind.
    """
    if kind not in KIND_LABELS:
        raise ValueError(f"unknown environment kind {kind!r}; expected one of "
                         f"{', '.join(KIND_LABELS)}")
    for key, value in table[kind].items():
        if (names is None or key in names) and getattr(flags, key) is None:
            setattr(flags, key, list(value) if isinstance(value, list) else value)
    return flags


def validate_flags(flags, extra_problems=(), parser=None):
    """Checks every flag at once and raises one FlagError listing all problems.

    Args:
      flags: the parsed Namespace, with the env defaults applied.
      extra_problems: problems found elsewhere (a variant's resolve_flags), reported first.
      parser: whose numeric flags' ranges to check (range_problems); None: the common flags'
        (add_common_flags). A problem found twice is reported once.
    """
    problems = list(extra_problems)
    problems += range_problems(flags, parser or common_parser())
    problems += video_and_wandb_problems(flags)
    problems += optimizer_problems(flags)
    if problems:
        raise FlagError(list(dict.fromkeys(problems)))


@functools.lru_cache(maxsize=None)
def common_parser():
    """A parser of the flags both learners understand (add_common_flags), built once: for
    code that needs their defaults without a learner's command line (benchmarks, tests)."""
    parser = argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)
    add_common_flags(parser)
    return parser


def video_and_wandb_problems(flags):
    """The problems with the video and W&B flags that need no environment (beast/video.py
    checks that the environment renders)."""
    problems = []
    if flags.record_video and flags.mode != "test":
        problems.append("--record_video records the games of --mode test; while training, "
                        "record evaluation games with --eval_video_interval_steps N.")
    videos = flags.record_video or flags.eval_video_interval_steps > 0
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


def resolve_precisions(flags, device_type, cpu_bf16=None):
    """Turns --precision and --acting_precision "auto" into bf16 where the learner's device
    is a CPU with bf16 instructions (emulated bf16 is slower than float32, and a GPU's runs
    are float32's), else fp32. Returns what the run's meta.json records: both precisions and
    why. cpu_bf16: machine.this_cpu()'s second value (None: this machine's)."""
    if cpu_bf16 is None:
        cpu_bf16 = machine.this_cpu()[1]
    native = device_type == "cpu" and machine.has_native_bf16(cpu_bf16)
    why = {}
    for name in ("precision", "acting_precision"):
        if getattr(flags, name) == "auto":
            setattr(flags, name, "bf16" if native else "fp32")
            why[name] = (f"auto: a {device_type.upper()} learner, the CPU's bf16: {cpu_bf16}")
        else:
            why[name] = "typed" if name in getattr(flags, "given", ()) else "saved or default"
    return {name: {"value": getattr(flags, name), "why": why[name]} for name in why}


def default_num_torch_threads(busy=0):
    """The learner's intra-op threads: the cores that `busy` processes beside it (actors,
    local env servers) leave, at least 1. An OpenMP thread that shares a core with one of
    them stalls every parallel op of the learner at its barrier."""
    return max(1, machine.cores() - busy)


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
