"""What MonoBeast and PolyBeast share around the learner step: the run's
set-up and checks, the learner's counters and checkpoints, signals,
offline evaluation and --mode test."""

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch

from beast import checkpoint as ckpt
from beast import envs
from beast import flags as beast_flags
from beast import learner
from beast import models
from beast import runlog

ENV_KEYS = ("frame", "reward", "done", "game_over", "episode_return", "episode_step",
            "last_action")


class Trainer:
    """The learner's shared state: model, optimizer, counters, logs; one lock."""

    def __init__(self, flags, run_dir, learner_model, actor_model, optimizer, scheduler,
                 logger, step=0, episode_state=None):
        self.flags = flags
        self.run_dir = run_dir
        self.model = learner_model
        self.actor_model = actor_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.logger = logger
        self.lock = threading.Lock()
        self.step = step
        self.episodes = runlog.EpisodeStats(window=100)
        if episode_state:
            self.episodes.load_state_dict(episode_state)
        self.stats = {}
        self.next_log_step = step + flags.log_interval_steps
        self.start_step = step
        self.start_time = time.time()
        self.last_checkpoint = time.time()
        self.evaluator = None
        self.error_count = None

    def learn(self, batch, state):
        with self.lock:
            stats = learner.learn_step(self.flags, self.model, self.optimizer, self.scheduler,
                                       batch, state)
            # Acting uses its own copy (shared memory in MonoBeast, the
            # inference device in PolyBeast): send it the new weights.
            if self.actor_model is not None and self.actor_model is not self.model:
                self.actor_model.load_state_dict(self.model.state_dict())
            returns, lengths = learner.episode_stats(batch)
            self.episodes.add(returns, lengths)
            self.step += self.flags.unroll_length * self.flags.batch_size
            stats["learning_rate"] = self.scheduler.get_last_lr()[0]
            stats["mean_episode_return"] = self.episodes.mean_return()
            stats["episodes"] = self.episodes.count
            stats["sps"] = (self.step - self.start_step) / max(1e-9, time.time() - self.start_time)
            if self.error_count is not None:
                stats["env_errors"] = self.error_count.value
            self.stats = stats
            if self.evaluator is not None:
                self.evaluator.snapshot_if_due(self)
            if self.step >= self.next_log_step or self.step >= self.flags.total_steps:
                self.logger.log(self.step, stats)
                while self.next_log_step <= self.step:
                    self.next_log_step += self.flags.log_interval_steps

    def done(self):
        return self.step >= self.flags.total_steps

    def housekeeping(self, status, evaluator):
        """Called often by the main loop: the status line, periodic
        checkpoints and offline evaluation."""
        if status is not None:
            status.update(self.step, self.stats)
        if time.time() - self.last_checkpoint > self.flags.checkpoint_interval_s:
            self.save()
            self.last_checkpoint = time.time()
        evaluator.maybe_run(self)

    def save(self):
        with self.lock:
            state = dict(
                model_state_dict=self.model.state_dict(),
                optimizer_state_dict=self.optimizer.state_dict(),
                scheduler_state_dict=self.scheduler.state_dict(),
                step=self.step,
                flags=ckpt.plain_flags(self.flags),
                episodes=self.episodes.state_dict(),
            )
            ckpt.save_checkpoint(self.run_dir.checkpoint_path, state)




class UserError(Exception):
    """A problem the user can fix; printed as one message, no traceback."""


def prepare(flags, variant_defaults=None):
    """Resolves the run directory, saved flags and environment defaults, and
    checks everything before any work starts.

    Args:
      variant_defaults: optional fn(flags, info) -> list of problems, which
        fills the variant's own env-dependent flags and checks them.
    Returns (run_dir, info, checkpoint or None).
    """
    # Nothing is created until every flag has been checked.
    run_dir = runlog.RunDir(flags.savedir, flags.xpid, create=False)
    flags.xpid = run_dir.xpid
    checkpoint = None
    if os.path.exists(run_dir.checkpoint_path):
        if os.path.exists(run_dir.flags_path):
            with open(run_dir.flags_path) as f:
                beast_flags.merge_saved_flags(flags, json.load(f), flags.given)
        try:
            checkpoint = ckpt.load_checkpoint(run_dir.checkpoint_path)
        except ckpt.CheckpointError as e:
            raise UserError(str(e)) from None
    elif flags.mode == "test":
        raise UserError(f"No checkpoint at {run_dir.checkpoint_path}: train with "
                        f"--xpid {flags.xpid} first, or give the --xpid of a trained run.")
    try:
        info = envs.env_info(flags)
    except (ValueError, ImportError) as e:
        raise UserError(str(e)) from None
    beast_flags.apply_env_defaults(flags, info)
    problems = list(variant_defaults(flags, info)) if variant_defaults else []
    if flags.num_torch_threads is None:
        flags.num_torch_threads = beast_flags.default_num_torch_threads()
    try:
        beast_flags.validate_flags(flags, problems)
    except beast_flags.FlagError as e:
        raise UserError(str(e)) from None
    if checkpoint is not None:
        try:
            ckpt.check_compatible(checkpoint["flags"], flags)
        except ckpt.CheckpointError as e:
            raise UserError(str(e)) from None
    try:
        run_dir.create()
    except runlog.RunDirError as e:
        raise UserError(str(e)) from None
    return run_dir, info, checkpoint


def build_model(flags, info):
    try:
        return models.create_model(flags, tuple(info["observation_shape"]), info["num_actions"])
    except ValueError as e:
        raise UserError(str(e)) from None




def install_signal_handlers():
    """SIGTERM and SIGINT set an event; the main loop stops and checkpoints."""
    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():  # A second Ctrl-C: stop at once.
            raise KeyboardInterrupt
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    return stop




def play_episodes(flags, model, num_episodes, seed):
    """Plays whole games with `model` on a fresh environment; returns their returns."""
    env = envs.RolloutAdapter(envs.create_env(flags), seed=seed)
    returns = []
    try:
        env_output = env.initial()
        state = model.initial_state(1)
        while len(returns) < num_episodes:
            inputs = {k: torch.as_tensor(np.asarray(env_output[k])).view(1, 1, *np.shape(env_output[k]))
                      for k in ENV_KEYS}
            with torch.no_grad():
                output, state = model(inputs, state)
            env_output = env.step(int(output["action"].item()))
            if env_output["game_over"]:
                returns.append(float(env_output["episode_return"]))
    finally:
        env.close()
    return returns


class Evaluator:
    """Offline evaluation (as in rlpyt): every --eval_interval_steps, a few
    episodes on separate environments, logged apart from training episodes.

    The learner takes a snapshot of the weights when a step crosses the
    interval (Trainer.learn calls snapshot_if_due under its lock); the main
    loop plays the episodes later, so learning never waits for them and no
    evaluation is skipped however fast training runs.
    """

    def __init__(self, flags, info, trainer):
        self.flags = flags
        self.info = info
        self.next_step = trainer.step + flags.eval_interval_steps
        self.model = None
        self.pending = []  # (step, weights) waiting to be played, oldest first.
        self.count = 0
        trainer.evaluator = self

    def snapshot_if_due(self, trainer):
        """Called with trainer.lock held."""
        if self.flags.eval_interval_steps <= 0 or trainer.step < self.next_step:
            return
        while self.next_step <= trainer.step:
            self.next_step += self.flags.eval_interval_steps
        weights = {k: v.detach().to("cpu", copy=True) for k, v in trainer.model.state_dict().items()}
        # A few at most: if playing falls far behind, the oldest go unplayed.
        self.pending = self.pending[-3:] + [(trainer.step, weights)]

    def maybe_run(self, trainer):
        with trainer.lock:
            pending, self.pending = self.pending, []
        for step, weights in pending:
            if self.model is None:
                self.model = build_model(self.flags, self.info)
            self.model.load_state_dict(weights)
            self.count += 1
            returns = play_episodes(self.flags, self.model, self.flags.eval_episodes,
                                    seed=10_000_000 + self.count)
            with trainer.lock:
                trainer.logger.log(step, {"eval_mean_episode_return": float(np.mean(returns)),
                                          "eval_episodes": len(returns)})


def test(flags, variant_defaults=None):
    run_dir, info, checkpoint = prepare(flags, variant_defaults)
    torch.set_num_threads(flags.num_torch_threads)
    model = build_model(flags, info)
    model.load_state_dict(checkpoint["model_state_dict"])
    returns = play_episodes(flags, model, flags.test_episodes, seed=flags.seed + 12345)
    print(f"Played {len(returns)} episodes with the checkpoint of step {checkpoint['step']}: "
          f"mean return {np.mean(returns):.2f} (min {np.min(returns):.1f}, "
          f"max {np.max(returns):.1f}).")
    return returns


def select_device(flags):
    use_cuda = torch.cuda.is_available() and not flags.disable_cuda
    return torch.device("cuda" if use_cuda else "cpu")


def create_learner(flags, info, run_dir, checkpoint, logger):
    """Builds the learner model and optimizer, restored from `checkpoint` when
    resuming, and the Trainer that owns them."""
    device = select_device(flags)
    flags.device = str(device)
    model = build_model(flags, info).to(device)
    optimizer, scheduler = learner.create_optimizer(flags, model)
    step, episode_state = 0, None
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
        step = int(checkpoint["step"])
        episode_state = checkpoint.get("episodes")
        print(f"Resuming {run_dir.path} from step {step}.", file=sys.stderr)
    return Trainer(flags, run_dir, model, None, optimizer, scheduler, logger,
                   step=step, episode_state=episode_state)


def parse_flags(parser, argv=None, always_given=()):
    """Parses argv; records which flags were typed (they win over a resumed
    run's saved flags), plus `always_given`, flags never taken from a saved run."""
    argv = sys.argv[1:] if argv is None else argv
    flags = parser.parse_args(argv)
    flags.given = beast_flags.explicit_flags(parser, argv) | set(always_given)
    return flags


def run_main(flags, train_fn, test_fn):
    """Runs train or test; a UserError ends with its message and exit code 2."""
    try:
        if flags.mode == "train":
            train_fn(flags)
        else:
            test_fn(flags)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
