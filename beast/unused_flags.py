"""The flags a user typed that would do nothing in this run: each is refused with what to
change, so that no typed flag is silently ignored. Only typed flags count (flags.typed): a
resumed run's flags.json fills every flag, and those values are the run's own.

beast/training.py asks for the problems of the modes every variant has (--mode test,
training without evaluation, a resume); each entry script asks for its own layout's.
"""

from beast import flags as beast_flags

# What --mode test reads: where the run is, how to play its checkpoint, and the environment
# and model flags (those must match the run's: beast/checkpoint.py check_compatible).
# --no_progress turns off test's status line as it does training's.
TEST_FLAGS = frozenset(["mode", "xpid", "savedir", "seed", "num_torch_threads",
                        "test_episodes", "eval_policy", "eval_envs", "eval_max_steps",
                        "record_video", "no_progress", "model", "use_lstm", "hidden_size",
                        "channels"])
# The flags of evaluation during training, and what they need to be read.
EVAL_GAME_FLAGS = ("eval_episodes", "eval_envs")  # the games of an evaluation
EVAL_PLAY_FLAGS = ("eval_policy", "eval_max_steps")  # how its games, and a video's, play


def problems(flags, saved_flags=None):
    """The typed flags that would do nothing with the others: a list of messages.

    Args:
      flags: the resolved flags, with flags.typed (training.parse_flags).
      saved_flags: the resumed run's flags.json (a dict), or None for a new run.
    """
    typed = getattr(flags, "typed", set())
    if flags.mode == "test":
        test_reads = TEST_FLAGS | set(beast_flags.env_flag_names())
        return [f"--{name} has no effect with --mode test, which plays the checkpoint of "
                f"--xpid {flags.xpid}: leave it out." for name in sorted(typed - test_reads)]
    found = []
    if "test_episodes" in typed:
        found.append("--test_episodes is for --mode test; in training, evaluation plays "
                     "--eval_episodes every --eval_interval_steps: leave it out.")
    no_eval = flags.eval_interval_steps == 0
    no_video = flags.eval_video_interval_steps == 0
    for name in EVAL_GAME_FLAGS + EVAL_PLAY_FLAGS:
        if name in typed and no_eval and (no_video or name in EVAL_GAME_FLAGS):
            needs = ("--eval_interval_steps N" if name in EVAL_GAME_FLAGS else
                     "--eval_interval_steps N or --eval_video_interval_steps N")
            found.append(f"--{name} has no effect without {needs} (evaluation is off): "
                         "give one, or leave it out.")
    if saved_flags is not None and "init" in typed and saved_flags.get("init") != flags.init:
        found.append(f"--init chooses a new run's weights; a resume keeps its checkpoint's "
                     f"(this run's were --init {saved_flags.get('init')}): leave it out, or "
                     "give a new --xpid.")
    return found


# What serial mode (--num_actors 0) never builds: it steps --batch_size environments in the
# learner's thread, with no actor processes, learner threads or buffers beyond a batch.
NOT_IN_SERIAL_MODE = ("envs_per_actor", "num_learner_threads", "actor_timeout_s", "num_buffers")


def monobeast_layout(flags):
    """MonoBeast's typed layout flags that its layout never reads (monobeast.resolve_flags)."""
    typed = getattr(flags, "typed", set())
    if flags.mode != "train":
        return []
    if flags.num_actors == 0:
        return [f"--{name} has no effect with --num_actors 0 (serial mode steps --batch_size "
                "environments in the learner's thread): leave it out."
                for name in NOT_IN_SERIAL_MODE if name in typed]
    if flags.deterministic and "actor_timeout_s" in typed:
        return ["--actor_timeout_s has no effect with --deterministic, which never restarts "
                "an actor: leave it out."]
    return []
