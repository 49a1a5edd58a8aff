"""The services a training run needs, called from each entry script's train().

    with training.Setup(flags, resolve_flags) as setup:  every flag checked, the run
                                                        directory claimed, a resume read,
                                                        seeds, signals, learner ranks, the
                                                        learner's model
        acting_model = ...                              the entry script's own
        with training.Run(setup, acting_model) as run:  the learner (learner.Learner),
                                                        logs, evaluation, status line; on
                                                        exit the last checkpoint
            ... actors -> batches -> run.learner.update -> run.record
            while run.running(): check the actors, run.check_threads(...),
                                 run.housekeeping()  status, checkpoints, evaluation

test() is --mode test; run_command() maps a problem the user can fix to one message.
The operating system's part (signals, thread names, malloc) is in beast/system.py.
"""

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
import traceback

import numpy as np
import torch

from beast import checkpoint as ckpt
from beast import distributed
from beast import envs
from beast import evaluation
from beast import flags as beast_flags
from beast import learner
from beast import machine
from beast import models
from beast import rollout
from beast import runlog
from beast import system
from beast import unused_flags
from beast import video


class UserError(Exception):
    """A problem the user can fix; printed as one message, no traceback."""


# Seconds without a learner update (the actors or their env servers delivering nothing) after
# which the run writes its checkpoint and says so, once per stall.
STALLED_S = 60.0


# ----------------------------------------------------------------------------
# Set-up.

@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What the run knows of its environment, read once from one instance before any work
    (envs.env_info): kind ("atari", "sticky_atari", "image", "vector", "continuous",
    "nethack"; the flag table's key), observation_shape and observation_dtype (dicts of them
    for a Dict observation), num_actions (a Box's dimension when continuous), action_low and
    action_high (a Box's float64 [A] bounds, else None), env_fields (the rollout fields the
    environment writes)."""

    kind: str
    observation_shape: object
    observation_dtype: object
    num_actions: int
    continuous: bool
    action_low: object
    action_high: object
    env_fields: tuple


def env_spec(flags):
    """The EnvSpec of --env, from one instance created and closed here (envs.env_info)."""
    return EnvSpec(**envs.env_info(flags))


def prepare_run(flags, resolve_flags=None, ranks=None):
    """Checks everything before any work starts, and only then creates the run directory:
    a refused run writes nothing. Reads a resumed run's saved flags and checkpoint, fills
    the environment's defaults and the entry script's own (resolve_flags: fn(flags, env) ->
    list of problems) and reports every problem at once.

    ranks: with several learner ranks, their beast.distributed.Ranks: rank 0 reads the
    run directory and every rank gets its xpid, saved flags and checkpoint.
    Returns (run_dir, EnvSpec, precisions, checkpoint or None); a training's run_dir is
    locked (runlog.RunDir.lock) on rank 0 until run_dir.unlock() or the process ends.
    """
    ranks = ranks or distributed.Single()
    run_dir = runlog.RunDir(flags.savedir, flags.xpid, create=False)
    claim = ranks.is_main and flags.mode == "train"
    try:
        run_dir, saved_flags, checkpoint = read_saved_run(flags, run_dir, ranks, claim)
        flags.xpid = run_dir.xpid
        if saved_flags is not None:
            ckpt.merge_saved_flags(flags, saved_flags, flags.given)
        env, precisions = resolve_flags_for_env(flags, resolve_flags, checkpoint)
        if ranks.is_main:  # the others write nothing
            run_dir.create()
            if claim:
                run_dir.lock()
        return run_dir, env, precisions, checkpoint
    except (runlog.RunDirError, ckpt.CheckpointError) as e:
        run_dir.unlock()
        raise UserError(str(e)) from None
    except BaseException:
        run_dir.unlock()
        raise


def read_saved_run(flags, run_dir, ranks, claim):
    """(run_dir, saved flags, checkpoint) of the run at --xpid; (run_dir, None, None) for a
    new run. A training claims an existing directory before reading it, so that a second
    learner started on a running xpid stops here, having written nothing."""
    problem, saved = None, (run_dir.xpid, None, None)
    if ranks.is_main:
        try:
            if claim and os.path.isdir(run_dir.path):
                run_dir.lock()
            saved = (run_dir.xpid, *_saved_flags_and_checkpoint(flags, run_dir))
        except (runlog.RunDirError, UserError) as e:
            problem = str(e)
    # One message on every rank, not rank 0's error and the others' hang.
    problem, (xpid, saved_flags, checkpoint) = ranks.share((problem, saved))
    if problem is not None:
        raise UserError(problem)
    if not ranks.is_main:
        run_dir = runlog.RunDir(flags.savedir, xpid, create=False)
    return run_dir, saved_flags, checkpoint


def _saved_flags_and_checkpoint(flags, run_dir):
    """On a resume (or --mode test): the saved flags (they fill the flags not given) and
    the checkpoint; (None, None) for a new run."""
    if not os.path.exists(run_dir.checkpoint_path):
        if flags.mode == "test":
            raise UserError(f"No checkpoint at {run_dir.checkpoint_path}: train with "
                            f"--xpid {run_dir.xpid} first, or give the --xpid of a trained run.")
        return None, None
    saved_flags = None
    if os.path.exists(run_dir.flags_path):
        with open(run_dir.flags_path) as f:
            saved_flags = json.load(f)
    try:
        return saved_flags, ckpt.load_checkpoint(run_dir.checkpoint_path)
    except ckpt.CheckpointError as e:
        raise UserError(str(e)) from None


def resolve_flags_for_env(flags, resolve_flags, checkpoint):
    """The environment's facts, the defaults that depend on them, and every problem with
    the flags, reported together; returns (EnvSpec, precisions)."""
    try:
        env = env_spec(flags)
    except (ValueError, ImportError, TypeError, KeyError) as e:
        raise UserError(str(e)) from None
    beast_flags.apply_machine_defaults(flags, env.kind, on_gpu_machine(flags))
    beast_flags.apply_optimizer_defaults(flags)
    beast_flags.apply_env_defaults(flags, env.kind)
    envs.fill_family_flags(flags)
    unused = unused_flags.problems(flags, checkpoint and checkpoint["flags"])
    if unused and flags.mode == "test":
        # The variant's problems would be about layouts that --mode test never builds.
        raise UserError(str(beast_flags.FlagError(unused)))
    problems = unused + (list(resolve_flags(flags, env)) if resolve_flags else [])
    problems += video.render_problems(flags)
    if flags.num_torch_threads is None:
        flags.num_torch_threads = beast_flags.default_num_torch_threads()
    precisions = beast_flags.resolve_precisions(flags, select_device(flags).type)
    try:
        beast_flags.validate_flags(flags, problems + model_problems(flags, env))
        if checkpoint is not None:
            ckpt.check_compatible(checkpoint["flags"], flags)
    except beast_flags.FlagError as e:
        raise UserError(str(e)) from None
    return env, precisions


def model_problems(flags, env):
    """Whether the model of --model can be built for this environment, and whether its
    outputs fit the rollout schema. A Dict observation gets DictNet unless --model names a
    net that reads Dict observations (beast/models.py READS_DICT), so asking for a net of
    one array is refused rather than ignored."""
    net = models.MODELS.get(flags.model)
    if (isinstance(env.observation_shape, dict) and "model" in flags.given
            and not getattr(net, "READS_DICT", False)):
        return [f"--model {flags.model}: {flags.env} has a Dict observation, which gets "
                "DictNet (beast/models.py: one encoder per entry, then the core) or a net that "
                "reads Dict observations (--model nethack for NetHack's); drop --model, "
                "or edit DictNet."]
    try:
        built = models.net_class(flags, env.observation_shape)
    except ValueError as e:  # an unknown --model, e.g. a saved run's
        return [str(e)]
    unread = [name for name in models.WIDTH_FLAGS
              if name in flags.given and name not in built.FLAGS]
    if unread and built is not net:  # DictNet, whatever --model says
        return [f"--{name} has no effect on {built.__name__}, the net of {flags.env}'s Dict "
                "observation: leave it out." for name in unread]
    if unread:
        return [f"--{name} has no effect on {built.__name__} (--model {flags.model}): leave "
                f"it out, or choose a --model that reads it "
                f"({', '.join(n for n, c in models.MODELS.items() if name in c.FLAGS)})."
                for name in unread]
    try:
        rollout.Schema.of(env.env_fields, build_model(flags, env), env.num_actions,
                          env.continuous)
    except (UserError, ValueError) as e:
        return [str(e)]
    return []


def build_model(flags, env):
    """A fresh model for the environment of EnvSpec env (models.create_model)."""
    try:
        # continuous only when it is: a create_model of (flags, shape, num_actions) still fits.
        extra = dict(continuous=True) if env.continuous else {}
        return models.create_model(flags, env.observation_shape, env.num_actions, **extra)
    except ValueError as e:
        raise UserError(str(e)) from None


def precision_label(flags):
    """The status line's note of the precisions: "bf16", "fp32", or "learner bf16, acting
    fp32" where they differ."""
    if flags.precision == flags.acting_precision:
        return flags.precision
    return f"learner {flags.precision}, acting {flags.acting_precision}"


def select_device(flags):
    use_cuda = torch.cuda.is_available() and not flags.disable_cuda
    return torch.device("cuda" if use_cuda else "cpu")


def on_gpu_machine(flags):
    """Whether this run's defaults take the GPU machine's layout (machine.is_gpu_machine)."""
    return machine.is_gpu_machine(select_device(flags).type)


# ----------------------------------------------------------------------------
# The learner and the run's statistics.

def build_acting_model(flags, env, device="cpu"):
    """A fresh model for acting, on `device`, in its net's layout and --acting_precision; the
    learner's weights reach it in Learner._publish."""
    model = models.to_acting_layout(build_model(flags, env).to(device))
    return models.to_acting_precision(model, flags.acting_precision)


class ThreadErrors:
    """The errors of a run's threads, kept for the main thread to raise (Run.supervise)."""

    def __init__(self):
        self._errors = []

    def thread(self, name, target, *args, on_error=None):
        """A daemon thread running target(*args); an exception is printed (a UserError only
        as its message, by the main thread), kept, and on_error() is called."""
        def run():
            system.name_os_thread(name)
            try:
                target(*args)
            except Exception as e:
                if not isinstance(e, (UserError, distributed.DistributedError)):
                    traceback.print_exc()
                # Without tracebacks (its own and its context's): their frames would keep
                # alive what the thread held, e.g. an inference Batch whose actors wait
                # until it is answered or dropped.
                cause = e
                while cause is not None:
                    cause.__traceback__ = None
                    cause = cause.__context__
                self._errors.append(e)
                if on_error is not None:
                    on_error()
        return threading.Thread(target=run, name=name, daemon=True)

    def raise_first(self):
        if self._errors:
            raise self._errors[0]


class Setup:
    """Everything before the acting side: a context manager that the entry script's train()
    enters first.

    On entry: the learner ranks joined (under torchrun), every flag checked (a refused run
    writes nothing), the run directory claimed, a resumed run's flags and checkpoint read,
    seeds, threads and signal handlers set. On exit: the directory freed for a resume, and
    the other learner ranks told how this one ended.

    Fields: flags, env (EnvSpec), precisions, run_dir, checkpoint (None for a new run),
    ranks, stop (set by SIGTERM or Ctrl-C), device (the learner's), model (the learner's, its
    weights not yet restored from the checkpoint).
    """

    def __init__(self, flags, resolve_flags, distributed_ok=False):
        self.flags, self.resolve_flags, self.distributed_ok = flags, resolve_flags, distributed_ok
        self.run_dir = None

    def __enter__(self):
        flags = self.flags
        self.ranks = join_ranks(flags, self.distributed_ok)
        try:
            self.run_dir, self.env, self.precisions, self.checkpoint = prepare_run(
                flags, self.resolve_flags, self.ranks)
            self.stop = start_process(flags, self.env)
            self.device = select_device(flags)
            # The learner's model first, before any other draw from the seeded generator: its
            # initial weights are the seed's, whatever the entry script builds next.
            self.model = models.to_learning_layout(build_model(flags, self.env).to(self.device))
        except BaseException as e:
            self.__exit__(type(e), e, None)
            raise
        return self

    def __exit__(self, kind, error, traceback_):
        if self.run_dir is not None:
            self.run_dir.unlock()  # the directory is free for a resume once this run has ended
        if error is not None:
            self.ranks.ended(f"{kind.__name__}: {error}".splitlines()[0])
        elif self.stop.is_set():
            self.ranks.ended("stopped on request")
        else:
            self.ranks.close()
        return False


class Run:
    """One training run, from the models to the last checkpoint: a context manager that the
    entry script's train() enters once the acting side's model exists.

    Holds the learner (learner.Learner: model, optimizer, step counter), the rollout schema,
    the run's statistics and logs, offline evaluation and the status line. The entry script
    calls record() after every learner update, running(), check_threads() and housekeeping()
    from the main thread; on exit the last evaluation is played, the last checkpoint written
    and one line says how the run ended.
    """

    def __init__(self, setup, acting_model):
        self.setup, self.acting_model = setup, acting_model
        self.flags, self.env, self.run_dir = setup.flags, setup.env, setup.run_dir
        self.stop, self.ranks, self.device = setup.stop, setup.ranks, setup.device
        self._exits = contextlib.ExitStack()

    def __enter__(self):
        try:
            logger = self._exits.enter_context(open_logs(self.setup))
            self._start(logger)
        except BaseException:
            self._exits.close()
            raise
        return self

    def _start(self, logger):
        flags, setup, env = self.flags, self.setup, self.env
        model = setup.model
        try:
            self.schema = rollout.Schema.of(env.env_fields, model, env.num_actions,
                                            env.continuous)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.learner = learner.Learner(flags, model, self.acting_model, setup.checkpoint,
                                       self.ranks)
        if setup.checkpoint is not None and self.ranks.is_main:
            print(f"Resuming {self.run_dir.path} from step {self.learner.step}.",
                  file=sys.stderr)
        self.stats = runlog.TrainingStats(flags, logger, self.learner.step,
                                   setup.checkpoint.get("episodes") if setup.checkpoint else None)
        # Rank 0 alone evaluates, shows the status line and writes checkpoints.
        self.evaluator = evaluation.Evaluator(
            flags, lambda: build_model(flags, env), self.learner.step,
            enabled=self.ranks.is_main, videos_dir=self.run_dir.videos_dir)
        self.status = (None if flags.no_progress or not self.ranks.is_main
                       else runlog.StatusLine(flags.total_steps,
                                              label=precision_label(flags)))
        self.errors = ThreadErrors()
        self.last_checkpoint = time.time()
        self.saved_step = self.learner.step if setup.checkpoint is not None else None
        self.checkpoint_error = None  # why the latest save failed, while it does
        self.stop_reported = False
        self.stall_step, self.stall_since = self.learner.step, time.monotonic()  # see housekeeping
        if self.ranks.is_distributed:  # the same weights everywhere, each rank its own actions
            torch.manual_seed(distributed.rank_seed(flags.seed, self.ranks.rank))

    def __exit__(self, kind, error, traceback_):
        try:
            if error is None:
                self.evaluator.run_pending(self.stats)  # the last snapshot, if not yet played
        finally:
            try:
                self.close()
            finally:
                self._exits.close()
        if error is None:
            report_end(self)
        return False

    def done(self):
        return self.learner.step >= self.flags.total_steps

    def thread(self, name, target, *args, on_error=None):
        """A daemon thread (not started) whose exception the main thread raises (running)."""
        return self.errors.thread(name, target, *args, on_error=on_error)

    def record(self, step, stats, batch):
        """After a learner update: its stats and finished games recorded (logs.csv when a row
        is due), its evaluation snapshot taken; a run of non-finite updates ends the run.
        stats is None when no update was made (total_steps reached)."""
        if stats is None:
            return
        self.stats.record(step, stats, *learner.episode_stats(batch))
        if self.learner.skipped_in_a_row >= self.flags.max_nonfinite_updates:
            self.stats.log(step, stats)  # the row that shows why the run stops
            raise UserError(
                f"{self.learner.skipped_in_a_row} learner updates in a row had a loss or "
                "gradient that is not finite; none reached the weights, and the checkpoint "
                "keeps the last good ones. Look for infinite or NaN rewards or observations "
                "from the environment, or lower --learning_rate.")
        self.evaluator.snapshot_if_due(step, self.learner)

    def running(self, poll_s=0.2):
        """The main thread's wait: sleeps poll_s, then False once total_steps is reached or a
        stop was requested. Raises the first error of the run's threads or of another learner
        rank."""
        time.sleep(poll_s)
        self.ranks.heartbeat()  # raises when another learner rank failed
        self.errors.raise_first()
        return not self.done() and not self.stopping()

    def check_threads(self, threads):
        """Raises when a thread of `threads` ended before total_steps (after the acting side's
        own check, whose error says why when it ended them)."""
        ended = [t.name for t in threads if not t.is_alive()]
        if ended and not self.done():
            self.errors.raise_first()
            raise RuntimeError(f"thread {', '.join(ended)} ended unexpectedly.")

    def stopping(self):
        """Whether a stop was requested (SIGTERM, Ctrl-C); says so once."""
        if self.stop.is_set() and not self.stop_reported:
            self.stop_reported = True
            print("\nStopping on request; the run can be resumed with "
                  f"--xpid {self.flags.xpid}.", file=sys.stderr)
        return self.stop.is_set()

    def housekeeping(self, env_errors=None):
        """Called often by the main thread: the status line, periodic checkpoints and
        offline evaluation. env_errors: the environment restarts so far, if counted."""
        if env_errors is not None:
            with self.stats.lock:
                self.stats.env_errors = env_errors
        if self.status is not None:
            self.status.update(self.learner.step, self.stats.latest)
        if time.time() - self.last_checkpoint > self.flags.checkpoint_interval_s:
            if not self.save():
                print(f"warning: {self.checkpoint_error}; {self.on_disk()}. Training goes "
                      f"on and tries again in {self.flags.checkpoint_interval_s:g} s.",
                      file=sys.stderr)
            self.last_checkpoint = time.time()
        self._checkpoint_if_stalled()
        self.evaluator.run_pending(self.stats)

    def _checkpoint_if_stalled(self):
        """When no learner update has come for STALLED_S (every env server out of reach, say),
        writes the checkpoint once, so that the wait for rollouts risks nothing learned."""
        step, now = self.learner.step, time.monotonic()
        if step != self.stall_step:
            self.stall_step, self.stall_since = step, now
            return
        if now - self.stall_since < STALLED_S or step == self.saved_step or step == 0:
            return
        if self.save():
            print(f"warning: no learner update for {now - self.stall_since:.0f} s; the "
                  f"checkpoint of step {step} is written. Waiting for rollouts.",
                  file=sys.stderr)
        self.stall_since = now

    def save(self):
        """Writes the checkpoint: everything a resume needs. Weights that are not finite
        never overwrite the last good checkpoint. Only rank 0 writes one. Returns False
        when the write failed (checkpoint_error says why)."""
        if not self.ranks.is_main:
            return True
        state = self.learner.state_dict()
        bad = [k for k, v in state["model_state_dict"].items()
               if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            print(f"warning: not writing a checkpoint: the weights {', '.join(bad[:3])} are not "
                  f"finite; {self.run_dir.checkpoint_path} keeps the last good ones.",
                  file=sys.stderr)
            return True
        with self.stats.lock:
            state["episodes"] = self.stats.episodes.state_dict()
        state["flags"] = ckpt.plain_flags(self.flags)
        try:
            ckpt.save_checkpoint(self.run_dir.checkpoint_path, state)
        except ckpt.CheckpointError as e:
            # A full disk or a quota must not end hours of training: the last checkpoint
            # stays whole (save_checkpoint is atomic) and the next interval tries again.
            self.checkpoint_error = str(e)
            return False
        self.saved_step, self.checkpoint_error = state["step"], None
        return True

    def on_disk(self):
        """Which checkpoint a resume would start from, in words (after checkpoint_error,
        which names the file)."""
        if self.saved_step is None:
            return "no checkpoint was written yet"
        return f"the checkpoint there keeps step {self.saved_step}"

    def close(self):
        """At the end, whatever ended it: the status line, the last checkpoint. A last
        checkpoint that cannot be written is reported by report_end."""
        if self.status is not None:
            self.status.close()
        self.save()


def join_ranks(flags, distributed_ok):
    """distributed.Single() for one learner; under torchrun, the process group joined."""
    if distributed.env_rank()[1] <= 1:
        return distributed.Single()
    if not distributed_ok:
        raise UserError("this learner runs as one process; for several learner ranks under "
                        "torchrun use polybeast (python -m polybeast).")
    try:
        return distributed.from_environment(flags)
    except ValueError as e:
        raise UserError(str(e)) from None


def start_process(flags, env):
    """Seeds, threads and malloc set for training; returns the event that a SIGTERM or
    Ctrl-C sets from now on (the finally blocks then stop whatever the run started)."""
    # Atari's learner step frees a few hundred MB that it allocates again at the next step;
    # before the learner's threads start, which pick their malloc arena at their first
    # allocation.
    if env.kind in ("atari", "sticky_atari"):
        system.reuse_freed_memory()
    torch.manual_seed(flags.seed)
    np.random.seed(flags.seed)
    torch.set_num_threads(flags.num_torch_threads)
    return system.install_signal_handlers()


def open_logs(setup):
    """meta.json written, then the logger as a context manager: logs.csv on rank 0, a line
    on stderr now and then on the other ranks."""
    flags, ranks, run_dir = setup.flags, setup.ranks, setup.run_dir
    if not ranks.is_main:
        return contextlib.nullcontext(runlog.RankLogger(ranks))
    runlog.write_metadata(run_dir, flags, dict(
        world_size=ranks.world_size, rank_hosts=list(ranks.hosts),
        machine=machine.describe(setup.device), precisions=setup.precisions))
    start_step = 0 if setup.checkpoint is None else setup.checkpoint["step"]
    return runlog.StatsLogger(run_dir, flags=flags, start_step=start_step)


def report_end(run):
    """One line on how the run ended; a last checkpoint that could not be written is an
    error that says how to resume."""
    flags, ranks = run.flags, run.ranks
    if run.checkpoint_error is not None:
        raise UserError(f"{run.checkpoint_error}. Training stopped at step {run.learner.step}; "
                        f"{run.on_disk()}. Once the directory can be written again (free "
                        f"space, raise the quota), the same command with --xpid {flags.xpid} "
                        "resumes from there.")
    where = f"Run saved in {run.run_dir.path}" if ranks.is_main else ranks.name(ranks.rank)
    print(f"Trained to step {run.learner.step}; mean episode return "
          f"{run.stats.episodes.mean_return():.2f}. {where}", file=sys.stderr)


# ----------------------------------------------------------------------------
# --mode test.

def test(flags, resolve_flags):
    """--mode test: plays --test_episodes with the run's checkpoint and records the result.
    resolve_flags: the entry script's, as for training."""
    if distributed.env_rank()[1] > 1:
        raise UserError("--mode test plays on one process: run it without torchrun.")
    run_dir, env, _, checkpoint = prepare_run(flags, resolve_flags)
    torch.set_num_threads(flags.num_torch_threads)
    model = build_model(flags, env)
    model.load_state_dict(checkpoint["model_state_dict"])
    paths = (video.paths_for_test(run_dir.videos_dir, checkpoint["step"], flags.test_episodes)
             if flags.record_video else [])
    seed = flags.seed + 12345
    progress = (None if flags.no_progress
                else evaluation.GameProgress(flags.test_episodes, flags.eval_policy))
    try:
        returns = evaluation.play_episodes(flags, model, flags.test_episodes, seed=seed,
                                           video_paths=paths, progress=progress)
    except video.VideoError as e:
        raise UserError(f"{e}; videos finished before it stay in "
                        f"{run_dir.videos_dir}.") from None
    finally:
        if progress is not None:
            progress.close()
    try:
        runlog.record_test(run_dir.tests_path, checkpoint["step"], flags.eval_policy, seed,
                           returns)
    except OSError as e:  # the result is printed below all the same
        print(f"warning: cannot record the test in {run_dir.tests_path}: {e.strerror or e}",
              file=sys.stderr)
    print(f"Played {len(returns)} episodes ({flags.eval_policy} actions) with the checkpoint "
          f"of step {checkpoint['step']}: "
          f"mean return {np.mean(returns):.2f} (min {np.min(returns):.1f}, "
          f"max {np.max(returns):.1f}).")
    if paths:
        print(f"Videos of the episodes: {os.path.dirname(paths[0])}{os.sep}")
    return returns


# ----------------------------------------------------------------------------
# The command line.

def parse_flags(parser, argv=None, always_given=()):
    """Parses argv; records which flags were typed (flags.typed), and flags.given: those
    and `always_given`, the flags never taken from a saved run (given flags win over a
    resumed run's saved ones)."""
    argv = sys.argv[1:] if argv is None else argv
    flags = parser.parse_args(argv)
    flags.typed = beast_flags.explicit_flags(parser, argv)
    flags.given = flags.typed | set(always_given)
    return flags


def run_command(train, test, flags):
    """Runs train(flags) or test(flags) as --mode says; a problem the user can fix ends with
    its message and exit code 2, anything else with its traceback."""
    try:
        if flags.mode == "train":
            train(flags)
        else:
            test(flags)
    except (UserError, distributed.DistributedError, runlog.TrackingError,
            evaluation.BadStep) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
