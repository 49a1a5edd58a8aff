"""Checkpoints that survive a crash mid-write and load without running pickled code.

A checkpoint is a dict of plain values and tensors, e.g.::

    {"model_state_dict": ..., "optimizer_state_dict": ..., "scheduler_state_dict": ...,
     "step": int, "flags": plain_flags(flags), "episodes": EpisodeStats.state_dict()}

(beast/training.py Run.save writes it.)

It is written to a temporary file beside the target and renamed over it, so the
previous checkpoint stays whole until the new one is complete; it is read with
``torch.load(..., weights_only=True)``, which only rebuilds tensors and plain types.
"""

import ast
import os
import tempfile

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not fit the flags given."""


# What weights_only loading can rebuild. Containers are checked recursively.
_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.device)


def _check_plain(obj, where):
    """Raises CheckpointError naming the first value weights_only loading would refuse."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise CheckpointError(
            f"checkpoint value state{where} has type {type(obj).__name__}, which "
            "torch.load(weights_only=True) cannot read back; convert it to a plain "
            "Python value (int, float, str, list, dict) or a tensor first"
        )


def plain_flags(flags):
    """vars(flags) with every value that is not None/bool/int/float/str, or a list of those
    (--channels), turned into str: the values flags.json reads back, so that a resume compares
    like with like (check_compatible)."""
    plain = (type(None), bool, int, float, str)
    items = flags.items() if isinstance(flags, dict) else vars(flags).items()
    return {
        key: value if isinstance(value, plain) or (
            isinstance(value, list) and all(isinstance(v, plain) for v in value)) else str(value)
        for key, value in items
    }


def save_checkpoint(path, state):
    """Writes state (a dict of plain values and tensors) to path, atomically.

    Either the whole new checkpoint is at path afterwards, or (on any error,
    including a crash) the previous file is there unchanged.
    A write that fails (a full disk, a quota, an I/O error) raises CheckpointError with
    the system's reason, and leaves no temporary file behind.
    """
    _check_plain(state, "")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".",
                                        suffix=".tmp")
    except OSError as e:
        raise CheckpointError(f"cannot write the checkpoint {path}: {_reason(e)}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the rename points at it
        os.replace(tmp_path, path)
    except BaseException as e:
        os.remove(tmp_path)
        if not isinstance(e, Exception):  # Ctrl-C and the like stay what they are
            raise
        raise CheckpointError(f"cannot write the checkpoint {path}: {_reason(e)}") from e
    try:
        # Makes the rename itself durable; not possible on every platform.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _reason(error):
    """The system's reason for a failed write. torch.save reports a full disk as a
    RuntimeError of its zip writer ("unexpected pos ..."), raised while handling the
    OSError that says what happened; that OSError is the one worth showing."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen.strerror or str(seen)
        seen = seen.__cause__ or seen.__context__
    return str(error)


def load_checkpoint(path, map_location="cpu"):
    """Reads a checkpoint written by save_checkpoint; returns its dict.

    Raises CheckpointError if the file is missing or cannot be read.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot read the checkpoint {path} ({type(e).__name__}: {e}). It may be "
            "truncated or not written by this code; move it away to start afresh, "
            "or pass a new --xpid"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    return state


# The flags that cannot change on a resume: the environment, its action set and the shape of
# the network that the checkpoint's weights fit. Every other flag typed on a resume takes effect
# (merge_saved_flags), the optimizer's included (beast/learner.py
# create_optimizer).
FIXED_ON_RESUME = ("env", "model", "use_lstm", "hidden_size", "channels", "full_action_space")
# Those of them that came later, and the value every run saved before them had.
FIXED_BEFORE_THE_FLAG = {"channels": [16, 32, 32], "full_action_space": False}


def check_compatible(checkpoint_flags, flags, keys=FIXED_ON_RESUME):
    """Raises CheckpointError listing every key in `keys` whose value differs.

    Args:
        checkpoint_flags: dict of the flags the checkpoint was trained with.
        flags: argparse.Namespace (or dict) of the flags given now.
        keys: the flags that must match for the checkpoint to be usable.
    """
    given = flags if isinstance(flags, dict) else vars(flags)
    missing = "(not set)"
    problems = []
    for key in keys:
        if key in checkpoint_flags:
            old = checkpoint_flags[key]
        elif key in FIXED_BEFORE_THE_FLAG and key in given:  # came later: the run had this
            old = FIXED_BEFORE_THE_FLAG[key]
        else:
            continue
        new = given.get(key, missing)
        if old != new:
            problems.append(f"checkpoint was trained with --{key} {old}, you gave --{key} {new}")
    if problems:
        raise CheckpointError(
            "the checkpoint does not fit the flags given (the environment and the network "
            "cannot change on a resume):\n  "
            + "\n  ".join(problems)
            + "\nleave these flags out (a resume takes them from the run), or pass a new "
            "--xpid to start a fresh run"
        )


def merge_saved_flags(flags, saved, given):
    """On resume or test: the saved run's flags, brought up to date. This is the one place
    where the flags of a run saved by older code meet today's, so that code reads flags.name
    and never needs a fallback of its own.

    A flag the user typed wins, and takes effect (the optimizer's included, see
    learner.create_optimizer; checkpoint.check_compatible refuses those that fix the network).
    Every other flag takes its saved value. A flag the saved run lacks (it came later) keeps
    the parser's default, or the env default that apply_env_defaults fills in next, unless
    BEFORE_THE_FLAG names the value that keeps the run doing what it did. A saved flag that
    the parser no longer has is dropped. The flags of CHOSEN_PER_MACHINE that the run's first
    command did not type are chosen again, for this machine; those it typed stay given.

    Args:
      flags: the parsed Namespace (changed in place).
      saved: dict of the run's flags.json.
      given: names typed on the command line (they win).
    Returns flags.
    """
    keep_fresh = {"mode", "xpid", "savedir", "given", "typed"}
    for key, value in saved.items():
        if key in given or key in keep_fresh or not hasattr(flags, key):
            continue
        setattr(flags, key, value)
    if "optimizer" in given and "epsilon" not in given and (
            flags.optimizer != saved.get("optimizer", "rmsprop")):
        # Another optimizer typed: its own epsilon default, not the old optimizer's value.
        flags.epsilon = None
    for key, value in BEFORE_THE_FLAG.items():
        if key not in saved and key not in given:
            setattr(flags, key, value)
    given_then = saved_names(saved.get("given"))
    kept = set()
    for key in CHOSEN_PER_MACHINE:
        if key in given:
            continue
        if given_then is None or key in given_then:
            kept.add(key)  # typed at the run's start (or saved before "given" was)
        else:
            setattr(flags, key, None)  # chosen again for this machine, as a new run would
    if kept and hasattr(flags, "given"):
        # Given from now on, so that flags.json keeps them for the resumes after this one.
        flags.given = set(flags.given) | kept
    if "penalty_step" not in saved and "penalty_step" not in given:
        # A NetHack run saved before --penalty_step keeps the penalty it trained with.
        from beast import nethack_env  # numpy and gymnasium only; nle is not imported

        flags.penalty_step = nethack_env.registered_penalty_step(saved.get("env", ""))
    return flags


# Flags whose default a run chooses for the machine it runs on, not for what it learns. A resume
# on another machine chooses them again unless the run's first command typed them: bf16 that a
# CPU without bf16 instructions emulates runs many times slower than float32, and a thread count
# fits one machine's cores.
CHOSEN_PER_MACHINE = ("precision", "acting_precision", "num_torch_threads")


def saved_names(text):
    """The set of flag names that flags.json records as str (plain_flags: "{'env', 'seed'}",
    "set()"), e.g. its "given", or None where the run saved none."""
    if text is None:
        return None
    if isinstance(text, (set, frozenset, list)):
        return set(text)
    return set() if text == "set()" else set(ast.literal_eval(text))


# Flags that changed what a run does by default after runs were saved without them, and the
# value that keeps such a run doing what it did: a resume must not change its loss, its
# learning-rate schedule or its network midway.
BEFORE_THE_FLAG = {"pg_clip": 0.0, "reward_scale": 1.0, "lr_warmup_steps": 0, "init": "torch",
                   "channels": [16, 32, 32], "normalize_rewards": False}
