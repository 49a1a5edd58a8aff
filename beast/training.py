"""The run skeleton that MonoBeast and PolyBeast share.

A variant (monobeast.py, polybeast.py) keeps only what is its own: how actors
produce rollouts and how they reach the learner threads. Everything around
that is here, written once:

    main -> train(flags, variant)
              prepare: flags checked, run directory, checkpoint to resume
              Run: Learner (model, optimizer, step counter)
                   TrainingStats (episode returns, logs.csv every --log_interval_steps)
                   Evaluator (offline evaluation), the status line, checkpoints
              variant.train_loop(run, ...): actors -> batches -> run.learner_thread
                   while the main thread runs run.supervise (stop requests,
                   errors, status, checkpoints, evaluation)
              the last checkpoint
         -> test(flags, variant): play --test_episodes with the checkpoint
"""

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch

from beast import checkpoint as ckpt
from beast import distributed
from beast import envs
from beast import flags as beast_flags
from beast import learner
from beast import machine
from beast import models
from beast import rollout
from beast import runlog
from beast import video


class UserError(Exception):
    """A problem the user can fix; printed as one message, no traceback."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a variant plugs into the skeleton.

    make_parser:     () -> argparse.ArgumentParser with the common flags and the variant's own.
    check_flags:     (flags, info) -> list of problems; fills the variant's env-dependent flags.
    acting_model:    (flags, info, model) -> what the actors act with, given the learner's
                     model; the learner sends it the weights after every step through its
                     load_state_dict.
    train_loop:      (run, acting_model, environments) -> None; returns when run.done(), on a
                     stop request, or raises.
    environments:    flags -> context manager entered before the models are built (PolyBeast
                     starts its env servers here, so they boot while the models are built).
    per_start_flags: flags never taken from a resumed run's saved flags.
    distributed:     whether it runs as several learner ranks under torchrun
                     (beast/distributed.py); a variant that does not is refused there.
    """

    make_parser: object
    check_flags: object
    acting_model: object
    train_loop: object
    environments: object = lambda flags: contextlib.nullcontext()
    per_start_flags: frozenset = frozenset()
    distributed: bool = False


# ----------------------------------------------------------------------------
# Set-up.

def prepare(flags, check_flags=None, ranks=None):
    """Resolves the run directory, saved flags and environment defaults, and
    checks everything before any work starts.

    Args:
      check_flags: optional fn(flags, info) -> list of problems, which fills
        the variant's own env-dependent flags and checks them.
      ranks: with several learner ranks, their beast.distributed.Ranks: rank 0 reads the
        run directory and every rank gets its xpid, saved flags and checkpoint.
    Returns (run_dir, info, checkpoint or None); a training's run_dir is locked
    (runlog.RunDir.lock) on rank 0 until run_dir.unlock() or the process ends.
    """
    ranks = ranks or distributed.Single()
    # Nothing is created until every flag has been checked.
    run_dir = runlog.RunDir(flags.savedir, flags.xpid, create=False)
    try:
        return _prepare(flags, check_flags, ranks, run_dir)
    except BaseException:
        run_dir.unlock()
        raise


def _prepare(flags, check_flags, ranks, run_dir):
    problem, saved = None, (run_dir.xpid, None, None)
    # A training claims its directory before reading it, so that a second learner
    # started on a running xpid stops here, having written nothing.
    claim = ranks.is_main and flags.mode == "train"
    if ranks.is_main:
        try:
            if claim and os.path.isdir(run_dir.path):
                run_dir.lock()
            saved = (run_dir.xpid, *_saved_run(flags, run_dir))
        except (runlog.RunDirError, UserError) as e:
            problem = str(e)
    # One message on every rank, not rank 0's error and the others' hang.
    problem, (xpid, saved_flags, checkpoint) = ranks.share((problem, saved))
    if problem is not None:
        raise UserError(problem)
    if not ranks.is_main:
        run_dir = runlog.RunDir(flags.savedir, xpid, create=False)
    flags.xpid = run_dir.xpid
    if saved_flags is not None:
        beast_flags.merge_saved_flags(flags, saved_flags, flags.given)
    try:
        info = envs.env_info(flags)
    except (ValueError, ImportError, TypeError, KeyError) as e:
        raise UserError(str(e)) from None
    beast_flags.apply_env_defaults(flags, info)
    problems = list(check_flags(flags, info)) if check_flags else []
    problems += video.render_problems(flags)  # before anything is written
    problems += model_problems(flags, info)
    if flags.num_torch_threads is None:
        flags.num_torch_threads = beast_flags.default_num_torch_threads()
    try:
        beast_flags.validate_flags(flags, problems)
        if checkpoint is not None:
            ckpt.check_compatible(checkpoint["flags"], flags)
        if ranks.is_main:  # the others write nothing
            run_dir.create()
            if claim:
                run_dir.lock()
    except (beast_flags.FlagError, ckpt.CheckpointError, runlog.RunDirError) as e:
        raise UserError(str(e)) from None
    return run_dir, info, checkpoint


def model_problems(flags, info):
    """--model names a network for one observation array. A Dict observation always gets
    DictNet (beast/models.py), so asking for another is refused rather than ignored."""
    if isinstance(info["observation_shape"], dict) and "model" in getattr(flags, "given", ()):
        return [f"--model {flags.model}: {flags.env} has a Dict observation, which always gets "
                "DictNet (beast/models.py: one encoder per entry, then the core); drop --model, "
                "or edit DictNet."]
    return []


def _saved_run(flags, run_dir):
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


def build_model(flags, info):
    try:
        # continuous only when it is: a create_model of (flags, shape, num_actions) still fits.
        extra = dict(continuous=True) if info.get("continuous") else {}
        return models.create_model(flags, info["observation_shape"], info["num_actions"],
                                   **extra)
    except ValueError as e:
        raise UserError(str(e)) from None


# A second stop signal within this many seconds of the first is the same request delivered
# twice, not a user insisting: GNU `timeout` signals its child and then the child's whole
# process group, so `timeout 3600 python -m monobeast ...` delivers SIGTERM twice at once.
REPEATED_SIGNAL_S = 2.0


def install_signal_handlers():
    """SIGTERM and SIGINT set an event; the main loop stops and checkpoints. Another one at
    least REPEATED_SIGNAL_S later (a second Ctrl-C) stops at once, without the checkpoint."""
    stop = threading.Event()
    first = []  # monotonic time of the first signal

    def handler(signum, frame):
        now = time.monotonic()
        if not first:
            first.append(now)
            stop.set()
        elif now - first[0] >= REPEATED_SIGNAL_S:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    return stop


def leave_stop_signals_to_the_learner():
    """In a child of the learner (MonoBeast's actors, PolyBeast's acting process, forked or spawned):
    Ctrl-C, and the SIGTERM that timeout(1) or Slurm send, go to the whole process group, and
    the learner checkpoints and then stops its children. Ignored rather than left to the
    handler above, which the fork copied: that one swallowed Process.terminate() and turned a
    second signal into a KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def select_device(flags):
    use_cuda = torch.cuda.is_available() and not flags.disable_cuda
    return torch.device("cuda" if use_cuda else "cpu")


# ----------------------------------------------------------------------------
# The learner and the run's statistics.

class Learner:
    """The model being trained, its optimizer and schedule, and the step counter; one lock.

    update() is one learner step; afterwards the acting model (MonoBeast's
    shared-memory copy, PolyBeast's inference replicas) gets the new weights.
    With several learner ranks, the gradients are averaged over them and the step
    counter counts every rank's steps (each rank makes the same number of updates).
    """

    def __init__(self, flags, model, acting_model, checkpoint=None, ranks=None):
        self.flags = flags
        self.model = model
        self.acting_model = acting_model
        self.ranks = ranks or distributed.Single()
        self.optimizer, self.scheduler = learner.create_optimizer(flags, model,
                                                                  self.ranks.world_size)
        self.step = 0
        self.skipped_updates = 0  # non-finite updates, all told
        self.skipped_in_a_row = 0
        self.lock = threading.Lock()
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model_state_dict"])
            self.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
            self.scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
            self.step = int(checkpoint["step"])
        if self.ranks.is_distributed:
            # The same starting weights on every rank, whatever its seed.
            model.load_state_dict(self.ranks.share(self.weights()))
        # The step of the acting model's weights (rollout.POLICY_STEP), beside its
        # state_dict so that checkpoints do not change; shared with MonoBeast's actors.
        acting_model.weights_step = torch.zeros((), dtype=torch.int64).share_memory_()
        self._publish()

    def publish(self):
        """The weights to the acting model again (PolyBeast's new acting process)."""
        with self.lock:
            self._publish()

    def _publish(self):
        """The new weights to the acting model, then their step."""
        self.acting_model.load_state_dict(self.model.state_dict())
        self.acting_model.weights_step.fill_(self.step)

    def update(self, batch, initial_agent_state):
        """One step on a batch [T+1, B, ...]; returns (step counter after it, stats).

        An update whose loss or gradient is not finite is skipped and counted
        (skipped_in_a_row); Run.learn decides when that ends the run. Returns (step, None)
        without an update once total_steps is reached (another learner thread got there
        first: with several ranks, an extra update would wait forever for the others).
        """
        with self.lock:
            if self.step >= self.flags.total_steps:
                return self.step, None
            average = self.ranks.average_gradients if self.ranks.is_distributed else None
            stats = learner.learn_step(self.flags, self.model, self.optimizer, self.scheduler,
                                       batch, initial_agent_state, average)
            steps_per_update = (self.flags.unroll_length * self.flags.batch_size *
                                self.ranks.world_size)
            stats["policy_lag"] = policy_lag(batch, self.step, steps_per_update)
            self.step += steps_per_update
            if stats["skipped_update"]:
                self._skipped(stats)
            else:
                self.skipped_in_a_row = 0
                self._publish()
            stats["skipped_updates"] = self.skipped_updates
            stats["learning_rate"] = self.scheduler.get_last_lr()[0]
            return self.step, stats

    def _skipped(self, stats):
        self.skipped_updates += 1
        self.skipped_in_a_row += 1
        losses = ", ".join(f"{k} {v:.4g}" for k, v in stats.items() if "loss" in k)
        print(f"warning: skipped the learner update at step {self.step}: the loss or its "
              f"gradient is not finite ({losses}, grad_norm {stats['grad_norm']:.4g}).",
              file=sys.stderr)

    def weights(self):
        """A CPU copy of the model's weights."""
        with self.lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def state_dict(self):
        """The learner's part of a checkpoint."""
        with self.lock:
            return dict(model_state_dict=self.model.state_dict(),
                        optimizer_state_dict=self.optimizer.state_dict(),
                        scheduler_state_dict=self.scheduler.state_dict(),
                        step=self.step)


def build_acting_model(flags, info, device="cpu"):
    """A fresh model for acting, on `device`, in --acting_precision (fp32 for the flags of
    a run saved before it existed); the learner's weights reach it in Learner._publish."""
    precision = getattr(flags, "acting_precision", None) or "fp32"
    return models.to_acting_precision(build_model(flags, info).to(device), precision)


def weights_step(acting_model):
    """The learner step of the acting model's weights (Learner._publish); 0 for a model that
    no learner writes to."""
    step = getattr(acting_model, "weights_step", None)
    return 0 if step is None else int(step)


def policy_lag(batch, step, steps_per_update):
    """How many updates older than the learner's weights at `step` the weights that acted in
    `batch` were, on average over its T transitions (the last of the T+1 steps only
    bootstraps). 0 when every action came from the newest weights."""
    acted = batch[rollout.POLICY_STEP.name][:-1].double().mean().item()
    return (step - acted) / steps_per_update


class TrainingStats:
    """Returns of the games that end in the training batches, the latest losses, and the
    rows of logs.csv (every --log_interval_steps); one lock, which also guards the logger."""

    def __init__(self, flags, logger, start_step, episode_state=None):
        self.flags = flags
        self.logger = logger
        self.lock = threading.Lock()
        self.episodes = runlog.EpisodeStats(window=100)
        if episode_state:
            self.episodes.load_state_dict(episode_state)
        self.latest = {}
        # The largest gradient norm since the last row: a row shows one update of the many
        # between rows, and an outlier that wrecks the policy is rarely the one shown.
        self.grad_norm_max = None
        self.env_errors = None  # the actors' environment restarts, when the variant counts them
        self.start_step, self.start_time = start_step, time.time()
        self.next_log_step = start_step + flags.log_interval_steps
        # learner_wait: the learner threads' seconds spent waiting for a batch since the last
        # row, against their seconds in all (threads x wall time since then).
        self.learner_threads, self.wait_s, self.window_start = 0, 0.0, None

    def learner_started(self):
        """A learner thread that pulls batches from the actors starts (learner_wait)."""
        with self.lock:
            self.learner_threads += 1
            if self.window_start is None:
                self.window_start = time.monotonic()

    def waited(self, seconds):
        """A learner thread waited `seconds` for its next batch."""
        with self.lock:
            self.wait_s += seconds

    def _learner_wait(self):
        """The share of the learner threads' time since the last row spent waiting for
        batches; None when no thread pulls batches (serial and --deterministic runs)."""
        if not self.learner_threads:
            return None
        now = time.monotonic()
        share = self.wait_s / max(1e-9, self.learner_threads * (now - self.window_start))
        self.wait_s, self.window_start = 0.0, now
        return min(1.0, share)

    def record(self, step, stats, batch):
        """Adds one learner step's stats and finished games; writes a row when one is due."""
        returns, lengths = learner.episode_stats(batch)
        with self.lock:
            self.episodes.add(returns, lengths)
            stats["mean_episode_return"] = self.episodes.mean_return()
            stats["mean_episode_length"] = self.episodes.mean_length()
            stats["episodes"] = self.episodes.count
            stats["sps"] = (step - self.start_step) / max(1e-9, time.time() - self.start_time)
            if self.env_errors is not None:
                stats["env_errors"] = self.env_errors
            if math.isfinite(stats.get("grad_norm", math.nan)):
                self.grad_norm_max = max(self.grad_norm_max or 0.0, stats["grad_norm"])
            self.latest = stats
            if step >= self.next_log_step or step >= self.flags.total_steps:
                if self.grad_norm_max is not None:
                    stats["grad_norm_max"] = self.grad_norm_max
                    self.grad_norm_max = None
                learner_wait = self._learner_wait()
                if learner_wait is not None:
                    stats["learner_wait"] = learner_wait
                self.logger.log(step, stats)
                while self.next_log_step <= step:
                    self.next_log_step += self.flags.log_interval_steps

    def log(self, step, stats, videos=None):
        """Writes a row of other stats (evaluation results), with videos {name: MP4 path}."""
        with self.lock:
            if videos:
                self.logger.log(step, stats, videos=videos)
            else:
                self.logger.log(step, stats)


def set_intra_op_threads(n):
    """Gives the calling thread n intra-op threads for its own parallel ops.

    With OpenMP the count is per thread, and a thread takes its count lazily, at its
    first parallel op or get_num_threads(), from the value that any thread set LAST: a
    set_num_threads() in a new thread that has not yet asked is overwritten by that lazy
    start, so its parallel ops run on the process-wide count after all. Asking first
    makes the thread's own setting stick."""
    torch.get_num_threads()
    torch.set_num_threads(n)


# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def reuse_freed_memory():
    """Makes glibc keep the memory a process frees for its next allocations, instead of
    handing it back to the kernel. Call it before the threads that allocate start.

    A learner step allocates and frees the activations and gradients of T x B frames, a few
    hundred MB on Atari. glibc serves blocks that large with mmap and returns them with
    munmap, so every step faults all of it in again, page by page: on 2 cores a fifth to a
    quarter of a Pong learner step's CPU went to the kernel's page faults. One arena for
    all threads (a thread's own arena cannot grow past 64 MB, so its large blocks are
    always mmapped), blocks up to 1 GiB from that heap, and no trimming of its top: the
    process stays at its peak size and reuses it. Only on Atari (keeps_freed_memory;
    --malloc_release turns it off there too). The price: an inference thread in the same process
    waits on the arena's lock while the learner holds it, which with the GIL left a tenth
    of 2 cores idle on Pong (README, "That idle tenth on Pong, looked into"); PolyBeast's
    acting process takes inference out of this process for that reason. Linux with
    glibc only; elsewhere, or if mallopt refuses, nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS has no mallopt)
        return
    mallopt(_M_ARENA_MAX, 1)
    # glibc refuses a threshold above its limit (32 MiB in some versions): then take that.
    if not mallopt(_M_MMAP_THRESHOLD, 1 << 30):
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


_PR_SET_NAME = 15  # prctl(2)


def name_os_thread(name):
    """Gives the calling thread `name` (its first 15 bytes) as its OS name, which top -H,
    py-spy and bench.cpushare show: Python's thread names stay inside Python, so without this
    every thread of a run is "python" and a profile cannot tell the learner from inference.
    Linux only; elsewhere, or if prctl is missing, it does nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ThreadErrors:
    """The errors of a run's threads, kept for the main thread to raise (Run.supervise)."""

    def __init__(self):
        self._errors = []

    def thread(self, name, target, *args, on_error=None):
        """A daemon thread running target(*args); an exception is printed (a UserError only
        as its message, by the main thread), kept, and on_error() is called."""
        def run():
            name_os_thread(name)
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


class Run:
    """One training run, as a variant's train_loop sees it.

    Learner threads call learner_thread(batches); the main thread calls supervise()
    (or, in a serial loop, housekeeping()) until done() or a stop request.
    """

    def __init__(self, flags, info, run_dir, checkpoint, logger, stop, model, acting_model,
                 ranks=None):
        self.flags, self.info, self.run_dir, self.stop = flags, info, run_dir, stop
        self.ranks = ranks or distributed.Single()
        self.device = next(model.parameters()).device
        try:
            self.schema = rollout.Schema.of(info["env_fields"], model, info["num_actions"],
                                            info.get("continuous", False))
        except ValueError as e:
            raise UserError(str(e)) from None
        self.learner = Learner(flags, model, acting_model, checkpoint, self.ranks)
        if checkpoint is not None and self.ranks.is_main:
            print(f"Resuming {run_dir.path} from step {self.learner.step}.", file=sys.stderr)
        self.stats = TrainingStats(flags, logger, self.learner.step,
                                   checkpoint.get("episodes") if checkpoint else None)
        # Rank 0 alone evaluates, shows the status line and writes checkpoints.
        self.evaluator = Evaluator(flags, info, self.learner.step, enabled=self.ranks.is_main,
                                   videos_dir=run_dir.videos_dir)
        self.status = (None if flags.no_progress or not self.ranks.is_main
                       else runlog.StatusLine(flags.total_steps))
        self.errors = ThreadErrors()
        self.last_checkpoint = time.time()
        self.saved_step = self.learner.step if checkpoint is not None else None  # on disk
        self.checkpoint_error = None  # why the latest save failed, while it does

    def done(self):
        return self.learner.step >= self.flags.total_steps

    def learn(self, batch, initial_agent_state):
        """One learner step on a batch [T+1, B, ...], with its stats and evaluation snapshot."""
        step, stats = self.learner.update(batch, initial_agent_state)
        if stats is None:
            return  # total_steps reached
        self.stats.record(step, stats, batch)
        if self.learner.skipped_in_a_row >= self.flags.max_nonfinite_updates:
            self.stats.log(step, stats)  # the row that shows why the run stops
            raise UserError(
                f"{self.learner.skipped_in_a_row} learner updates in a row had a loss or "
                "gradient that is not finite; none reached the weights, and the checkpoint "
                "keeps the last good ones. Look for infinite or NaN rewards or observations "
                "from the environment, or lower --learning_rate.")
        self.evaluator.snapshot_if_due(step, self.learner)

    def learner_thread(self, batches):
        """The body of a learner thread: learns on (batch, initial_agent_state) pairs until
        total_steps or the end of `batches`."""
        set_intra_op_threads(self.flags.num_torch_threads)
        self.stats.learner_started()
        batches = iter(batches)
        while not self.done():
            start = time.monotonic()
            pair = next(batches, None)
            if pair is None or self.done():
                return
            self.stats.waited(time.monotonic() - start)
            self.learn(*pair)

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
        self.evaluator.run_pending(self.stats)

    def supervise(self, threads, check=None, env_errors=None):
        """The main thread of a run with actors: until total_steps, a stop request or a
        failure. Raises the first error of a thread, and whatever check() raises (a dead
        actor process, say); a thread of `threads` that ends early is an error too."""
        while not self.done():
            time.sleep(0.2)
            self.ranks.heartbeat()  # raises when another learner rank failed
            if self.stop.is_set():
                print("\nStopping on request; the run can be resumed with "
                      f"--xpid {self.flags.xpid}.", file=sys.stderr)
                return
            self.errors.raise_first()
            if check is not None:
                check()
            ended = [t.name for t in threads if not t.is_alive()]
            if ended and not self.done():
                self.errors.raise_first()
                raise RuntimeError(f"thread {', '.join(ended)} ended unexpectedly.")
            self.housekeeping(env_errors() if env_errors is not None else None)
        self.errors.raise_first()

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
        checkpoint that cannot be written is reported by _train, once the run is shut."""
        if self.status is not None:
            self.status.close()
        self.save()


def train(flags, variant):
    """Trains with `variant`'s actors until --total_steps or a stop request; returns the Run.

    Under torchrun, this process is one of several learner ranks (beast/distributed.py);
    when it ends with an error, its message goes to the others, which stop too.
    """
    ranks = join_ranks(flags, variant)
    try:
        run = _train(flags, variant, ranks)
    except BaseException as e:
        ranks.ended(f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    if run.stop.is_set():
        ranks.ended("stopped on request")
    else:
        ranks.close()
    return run


def join_ranks(flags, variant):
    """distributed.Single() for one learner; under torchrun, the process group joined."""
    if distributed.env_rank()[1] <= 1:
        return distributed.Single()
    if not variant.distributed:
        raise UserError("this learner runs as one process; for several learner ranks under "
                        "torchrun use polybeast (python -m polybeast).")
    try:
        return distributed.from_environment(flags)
    except ValueError as e:
        raise UserError(str(e)) from None


def _train(flags, variant, ranks):
    run_dir, info, checkpoint = prepare(flags, variant.check_flags, ranks)
    try:
        return _train_prepared(flags, variant, ranks, run_dir, info, checkpoint)
    finally:
        run_dir.unlock()  # the directory is free for a resume once this run has ended


def keeps_freed_memory(flags, info):
    """Whether the learner process keeps what it frees (reuse_freed_memory): on Atari, where
    a step frees a few hundred MB (Pong: 8-13% more SPS on 2 cores). Elsewhere the blocks are
    small and one arena for all threads costs more than it saves (MinAtar Freeway's
    PolyBeast: about 9% fewer SPS), so glibc keeps its default there."""
    return info["kind"] == "atari" and not flags.malloc_release


def _train_prepared(flags, variant, ranks, run_dir, info, checkpoint):
    if keeps_freed_memory(flags, info):  # before the learner's threads start: they pick
        reuse_freed_memory()             # their arena at their first allocation
    torch.manual_seed(flags.seed)
    np.random.seed(flags.seed)
    torch.set_num_threads(flags.num_torch_threads)
    # Before anything slow: a SIGTERM or Ctrl-C from now on stops the run through the
    # finally blocks, which also stop whatever the variant started.
    stop = install_signal_handlers()
    with variant.environments(flags) as environments:
        device = select_device(flags)  # after the servers' start: they boot meanwhile
        if ranks.is_main:
            runlog.write_metadata(run_dir, flags, dict(
                world_size=ranks.world_size, rank_hosts=list(ranks.hosts),
                machine=machine.describe(device)))
        with (runlog.StatsLogger(run_dir, flags=flags) if ranks.is_main
              else contextlib.nullcontext(RankLogger(ranks))) as logger:
            model = build_model(flags, info).to(device)
            acting_model = variant.acting_model(flags, info, model)
            run = Run(flags, info, run_dir, checkpoint, logger, stop, model, acting_model, ranks)
            if ranks.is_distributed:  # the same weights everywhere, each rank its own actions
                torch.manual_seed(distributed.rank_seed(flags.seed, ranks.rank))
            try:
                variant.train_loop(run, acting_model, environments)
                run.evaluator.run_pending(run.stats)  # the last snapshot, if training outran it
            finally:
                run.close()
    if run.checkpoint_error is not None:
        raise UserError(f"{run.checkpoint_error}. Training stopped at step {run.learner.step}; "
                        f"{run.on_disk()}. Once the directory can be written again (free "
                        f"space, raise the quota), the same command with --xpid {flags.xpid} "
                        "resumes from there.")
    where = f"Run saved in {run_dir.path}" if ranks.is_main else ranks.name(ranks.rank)
    print(f"Trained to step {run.learner.step}; mean episode return "
          f"{run.stats.episodes.mean_return():.2f}. {where}", file=sys.stderr)
    return run


class RankLogger:
    """The logger of a learner rank other than 0: its own throughput and returns, on
    stderr; rank 0 writes the run's logs."""

    def __init__(self, ranks):
        self.ranks = ranks

    def log(self, step, stats):
        if "sps" not in stats:
            return
        print(f"{self.ranks.name(self.ranks.rank)}: step {step}, "
              f"{stats['sps'] / self.ranks.world_size:.0f} SPS on this rank, mean episode "
              f"return {stats.get('mean_episode_return', float('nan')):.2f}", file=sys.stderr)


# ----------------------------------------------------------------------------
# Evaluation and --mode test.

def play_episodes(flags, model, num_episodes, seed, video_paths=()):
    """Plays whole games with `model` on a fresh environment; returns their returns.

    With --eval_policy greedy (the default) the model acts greedily, in eval mode (the argmax
    of the policy), as TorchBeast's test mode does; with sample, in train mode.
    video_paths: MP4 files for the screens of the first games (beast/video.py).
    A game longer than --eval_max_steps is stopped there and counts with its return so far,
    with a warning: a greedy policy can play some games without end (MinAtar's have no time
    limit), and an evaluation that never ends would never be logged.
    """
    env = envs.RolloutAdapter(video.create_env(flags, video_paths), seed=seed)
    model.train(flags.eval_policy == "sample")
    max_steps = getattr(flags, "eval_max_steps", 0)
    returns = []
    try:
        env_output = env.initial()
        state = model.initial_state(1)
        while len(returns) < num_episodes:
            inputs = {k: torch.as_tensor(np.asarray(v)).view(1, 1, *np.shape(v))
                      for k, v in env_output.items()}
            with torch.no_grad():
                output, state = model(inputs, state)
            env_output = env.step(output["action"][0, 0].numpy())  # an int64, or float32 [A]
            if env_output["game_over"]:
                returns.append(float(env_output["episode_return"]))
            elif 0 < max_steps <= env_output["episode_step"]:
                returns.append(float(env_output["episode_return"]))
                print(f"warning: game {len(returns)} stopped at --eval_max_steps "
                      f"{max_steps:,}, with a return of {returns[-1]:g} so far.",
                      file=sys.stderr)
                env_output = env.initial()
                state = model.initial_state(1)
    finally:
        env.close()
    return returns


class Evaluator:
    """Offline evaluation (as in rlpyt): every --eval_interval_steps, a few
    episodes on separate environments, logged apart from training episodes; every
    --eval_video_interval_steps, one game recorded as an MP4 (beast/video.py).

    A learner thread takes a snapshot of the weights when a step crosses the
    interval (snapshot_if_due); the main thread plays the episodes later
    (run_pending), so learning never waits for them and no evaluation is
    skipped however fast training runs.
    """

    def __init__(self, flags, info, start_step, enabled=True, videos_dir=None):
        self.flags = flags
        self.info = info
        self.videos_dir = videos_dir
        # Two schedules, evaluations and videos (--eval_video_interval_steps: one recorded
        # game, in videos_dir); a snapshot serves whichever is due. An interval of 0 is off.
        self.intervals = (flags.eval_interval_steps,
                          flags.eval_video_interval_steps if videos_dir else 0)
        self.enabled = enabled and any(i > 0 for i in self.intervals)
        self.next_steps = [start_step + i if i > 0 else float("inf") for i in self.intervals]
        self.model = None
        self.lock = threading.Lock()
        # (step, weights, evaluate, record) waiting to be played, oldest first. GUARDED_BY(lock)
        self.pending = []
        self.count = 0

    def snapshot_if_due(self, step, learner_):
        if not self.enabled or step < min(self.next_steps):
            return
        with self.lock:
            due = [step >= next_step for next_step in self.next_steps]
            if not any(due):  # another learner thread took it
                return
            for k, interval in enumerate(self.intervals):
                while self.next_steps[k] <= step:
                    self.next_steps[k] += interval
        weights = learner_.weights()
        with self.lock:
            # A few at most: if playing falls far behind, the oldest go unplayed.
            self.pending = self.pending[-3:] + [(step, weights, *due)]

    def run_pending(self, stats):
        with self.lock:
            pending, self.pending = self.pending, []
        for step, weights, evaluate, record in pending:
            if self.model is None:
                self.model = build_model(self.flags, self.info)
            self.model.load_state_dict(weights)
            self.count += 1
            paths = [video.path_for_eval(self.videos_dir, step)] if record else []
            # A video alone is one game; with an evaluation, its first game.
            games = self.flags.eval_episodes if evaluate else 1
            seed = 10_000_000 + self.count
            try:
                returns = play_episodes(self.flags, self.model, games, seed, video_paths=paths)
            except video.VideoError as e:  # a full disk, say: no reason to end the run
                print(f"warning: {e}. Training goes on.", file=sys.stderr)
                if not evaluate:
                    continue
                paths = []
                returns = play_episodes(self.flags, self.model, games, seed)
            row = {"video_episode_return": returns[0]} if paths else {}
            if evaluate:
                row.update(eval_mean_episode_return=float(np.mean(returns)),
                           eval_episodes=len(returns), eval_policy=self.flags.eval_policy)
            stats.log(step, row, videos={"eval_video": paths[0]} if paths else None)


def test(flags, variant):
    if distributed.env_rank()[1] > 1:
        raise UserError("--mode test plays on one process: run it without torchrun.")
    run_dir, info, checkpoint = prepare(flags, variant.check_flags)
    torch.set_num_threads(flags.num_torch_threads)
    model = build_model(flags, info)
    model.load_state_dict(checkpoint["model_state_dict"])
    paths = (video.paths_for_test(run_dir.videos_dir, checkpoint["step"], flags.test_episodes)
             if flags.record_video else [])
    seed = flags.seed + 12345
    try:
        returns = play_episodes(flags, model, flags.test_episodes, seed=seed, video_paths=paths)
    except video.VideoError as e:
        raise UserError(f"{e}; videos finished before it stay in "
                        f"{run_dir.videos_dir}.") from None
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
    """Parses argv; records which flags were typed (they win over a resumed
    run's saved flags), plus `always_given`, flags never taken from a saved run."""
    argv = sys.argv[1:] if argv is None else argv
    flags = parser.parse_args(argv)
    flags.given = beast_flags.explicit_flags(parser, argv) | set(always_given)
    return flags


def main(variant, argv=None):
    """Runs train or test; a UserError ends with its message and exit code 2."""
    flags = parse_flags(variant.make_parser(), argv, variant.per_start_flags)
    try:
        if flags.mode == "train":
            train(flags, variant)
        else:
            test(flags, variant)
    except (UserError, distributed.DistributedError, runlog.TrackingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
