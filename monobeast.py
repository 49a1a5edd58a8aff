"""MonoBeast: single-machine IMPALA in pure Python and PyTorch.

Data path:
  actor processes (each steps --envs_per_actor environments and runs one
  batched forward pass for all of them)
    -> shared-memory rollout buffers [T+1, num_buffers, ...]
    -> full_queue (buffer indices) -> learner threads (V-trace loss, RMSprop)
    -> free_queue (indices back to the actors); new weights -> actor model.

Run `python -m monobeast --help` for the flags.  `--num_actors 0` steps the
environments in the learner's own process (serial mode, for debuggers).
"""

import argparse
import json
import multiprocessing as std_mp
import os
import queue
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
from torch import multiprocessing as mp

from beast import checkpoint as ckpt
from beast import envs
from beast import flags as beast_flags
from beast import learner
from beast import models
from beast import runlog

ENV_KEYS = ("frame", "reward", "done", "game_over", "episode_return", "episode_step",
            "last_action")


def make_parser():
    parser = argparse.ArgumentParser(
        description="MonoBeast: single-machine IMPALA.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    beast_flags.add_common_flags(parser)
    # Actors and buffers.
    parser.add_argument("--num_actors", type=int, default=2,
                        help="Actor processes; 0 steps the environments in the "
                             "learner's process (serial mode, for debugging).")
    parser.add_argument("--envs_per_actor", type=int, default=None,
                        help="Environments each actor steps together, with one "
                             "forward pass for all (default: 4 Atari, 8 vector).")
    parser.add_argument("--num_buffers", type=int, default=None,
                        help="Shared-memory rollout buffers "
                             "(default: max(2 * num_actors * envs_per_actor, 2 * batch_size)).")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="Learner forward pass precision (V-trace and losses stay fp32).")
    return parser


# ----------------------------------------------------------------------------
# Buffers.

def rollout_specs(flags, info):
    """name -> (shape after [T+1], dtype) of every rollout tensor."""
    obs_dtype = torch.from_numpy(np.zeros(0, dtype=info["observation_dtype"])).dtype
    return dict(
        frame=(tuple(info["observation_shape"]), obs_dtype),
        reward=((), torch.float32),
        done=((), torch.bool),
        game_over=((), torch.bool),
        episode_return=((), torch.float32),
        episode_step=((), torch.int32),
        last_action=((), torch.int64),
        policy_logits=((info["num_actions"],), torch.float32),
        baseline=((), torch.float32),
        action=((), torch.int64),
    )


def create_buffers(flags, specs):
    """Shared-memory tensors [T+1, num_buffers, ...]: index_select on dim 1
    gives a time-major batch in one copy."""
    buffers = {}
    for key, (shape, dtype) in specs.items():
        size = (flags.unroll_length + 1, flags.num_buffers) + shape
        buffers[key] = torch.zeros(size, dtype=dtype).share_memory_()
    return buffers


def create_state_buffers(model, num_buffers):
    """The agent's core state before step 0 of each buffer: [num_buffers, L, H]."""
    return tuple(torch.zeros((num_buffers,) + s[:, 0].shape, dtype=s.dtype).share_memory_()
                 for s in model.initial_state(1))


# ----------------------------------------------------------------------------
# Acting.

class Sampler:
    """Steps a group of environments in lockstep and writes their rollouts.

    Each environment owns one buffer index per unroll. One forward pass of the
    model serves the whole group, which is what makes acting on the CPU cheap.
    """

    def __init__(self, flags, model, buffers, state_buffers, num_envs, seed,
                 error_count=None, name="actor"):
        self.flags = flags
        self.model = model
        self.name = name
        self.error_count = error_count
        self.seed = seed
        self.num_envs = num_envs
        self.buffers = {k: v.numpy() for k, v in buffers.items()}
        self.state_buffers = state_buffers
        self.envs = [self._make_env(j) for j in range(num_envs)]
        # The group's current step, [k, ...] numpy arrays; torch views share them.
        self.current = {k: np.zeros((num_envs,) + v.shape[2:], dtype=v.dtype)
                        for k, v in self.buffers.items() if k in ENV_KEYS}
        self.current_torch = {k: torch.from_numpy(v) for k, v in self.current.items()}
        for j, env in enumerate(self.envs):
            self._store(j, env.initial())
        self.agent_state = model.initial_state(num_envs)
        # State before the forward pass that produced the pending agent output.
        self.state_before = self.agent_state
        self.agent_output = self._act()

    def _make_env(self, j, restart=0):
        env_seed = self.seed * 1000 + j + 100_000 * restart
        return envs.RolloutAdapter(envs.create_env(self.flags), seed=env_seed)

    def _store(self, j, env_output):
        for key in ENV_KEYS:
            self.current[key][j] = env_output[key]

    def _act(self):
        inputs = {k: v.unsqueeze(0) for k, v in self.current_torch.items()}
        self.state_before = self.agent_state
        with torch.no_grad():
            output, self.agent_state = self.model(inputs, self.agent_state)
        return {k: v[0].numpy() for k, v in output.items()}

    def _write(self, t, indices):
        for key, value in self.current.items():
            self.buffers[key][t, indices] = value
        for key, value in self.agent_output.items():
            self.buffers[key][t, indices] = value

    def _step_envs(self):
        actions = self.agent_output["action"]
        for j, env in enumerate(self.envs):
            try:
                env_output = env.step(int(actions[j]))
            except Exception:  # A broken environment must not end the run.
                traceback.print_exc()
                print(f"[{self.name}] environment {j} raised in step; restarting it.",
                      file=sys.stderr)
                env.close()
                restarts = 1
                if self.error_count is not None:
                    with self.error_count.get_lock():
                        self.error_count.value += 1
                        restarts = self.error_count.value
                self.envs[j] = env = self._make_env(j, restarts)
                env_output = env.initial()
            self._store(j, env_output)

    def unroll(self, indices):
        """Fills buffers [0..T, indices]: step 0 repeats the last step of the
        previous unroll, so the learner can bootstrap across the seam."""
        indices = np.asarray(indices)
        for s, state in zip(self.state_buffers, self.state_before):
            s[torch.from_numpy(indices)] = state.transpose(0, 1)
        self._write(0, indices)
        for t in range(1, self.flags.unroll_length + 1):
            self._step_envs()                # action[t-1] -> env output x_t
            self.agent_output = self._act()  # obs[t] -> action[t]
            self._write(t, indices)

    def close(self):
        for env in self.envs:
            env.close()


def act(actor_index, flags, free_queue, full_queue, model, buffers, state_buffers,
        error_count):
    """Actor process: takes free buffer indices, fills them, hands them on."""
    # Ctrl-C goes to the whole process group; the learner decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    torch.manual_seed(flags.seed * 7919 + actor_index)
    sampler = Sampler(flags, model, buffers, state_buffers, flags.envs_per_actor,
                      seed=flags.seed * 100 + actor_index, error_count=error_count,
                      name=f"actor {actor_index}")
    try:
        while True:
            indices = []
            for _ in range(flags.envs_per_actor):
                index = free_queue.get()
                if index is None:
                    return
                indices.append(index)
            sampler.unroll(indices)
            for index in indices:
                full_queue.put(index)
    finally:
        sampler.close()


# ----------------------------------------------------------------------------
# Learning.

def get_batch(flags, full_queue, free_queue, buffers, state_buffers, device):
    """Takes batch_size filled buffers; returns (batch, initial_agent_state) or None at shutdown."""
    indices = [full_queue.get() for _ in range(flags.batch_size)]
    if any(i is None for i in indices):
        return None
    index = torch.tensor(indices)
    batch = {k: v.index_select(1, index) for k, v in buffers.items()}
    state = tuple(s.index_select(0, index).transpose(0, 1).contiguous() for s in state_buffers)
    for i in indices:  # The copies above are done: the buffers can be refilled.
        free_queue.put(i)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    state = tuple(s.to(device, non_blocking=True) for s in state)
    return batch, state


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
        self.error_count = None

    def learn(self, batch, state):
        with self.lock:
            stats = learner.learn_step(self.flags, self.model, self.optimizer, self.scheduler,
                                       batch, state)
            if self.actor_model is not self.model:
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
            if self.step >= self.next_log_step or self.step >= self.flags.total_steps:
                self.logger.log(self.step, stats)
                while self.next_log_step <= self.step:
                    self.next_log_step += self.flags.log_interval_steps

    def done(self):
        return self.step >= self.flags.total_steps

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


def learner_loop(trainer, flags, full_queue, free_queue, buffers, state_buffers, device,
                 errors):
    try:
        while not trainer.done():
            item = get_batch(flags, full_queue, free_queue, buffers, state_buffers, device)
            if item is None:
                return
            trainer.learn(*item)
    except Exception as e:  # Reported by the main thread, which stops the run.
        traceback.print_exc()
        errors.append(e)


# ----------------------------------------------------------------------------
# Set-up shared by training and testing.

class UserError(Exception):
    """A problem the user can fix; printed as one message, no traceback."""


def parse_flags(argv=None):
    parser = make_parser()
    argv = sys.argv[1:] if argv is None else argv
    flags = parser.parse_args(argv)
    flags.given = beast_flags.explicit_flags(parser, argv)
    return flags


def prepare(flags):
    """Resolves the run directory, saved flags and environment defaults, and
    checks everything before any work starts. Returns (run_dir, info, checkpoint)."""
    try:
        run_dir = runlog.RunDir(flags.savedir, flags.xpid)
    except runlog.RunDirError as e:
        raise UserError(str(e)) from None
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
    if flags.envs_per_actor is None:
        flags.envs_per_actor = 4 if info["is_atari"] else 8
    if flags.num_buffers is None:
        flags.num_buffers = max(2 * max(flags.num_actors, 1) * flags.envs_per_actor,
                                2 * flags.batch_size)
    if flags.num_torch_threads is None:
        flags.num_torch_threads = beast_flags.default_num_torch_threads()
    problems = []
    if flags.num_actors < 0:
        problems.append(f"--num_actors must not be negative (got {flags.num_actors}).")
    if flags.envs_per_actor < 1:
        problems.append(f"--envs_per_actor must be at least 1 (got {flags.envs_per_actor}).")
    if flags.num_buffers < flags.batch_size:
        problems.append(f"--num_buffers ({flags.num_buffers}) must be at least --batch_size "
                        f"({flags.batch_size}), or no batch can ever be formed.")
    if flags.num_actors > 0 and flags.num_buffers < flags.num_actors * flags.envs_per_actor:
        problems.append(f"--num_buffers ({flags.num_buffers}) must be at least --num_actors x "
                        f"--envs_per_actor ({flags.num_actors * flags.envs_per_actor}).")
    try:
        beast_flags.validate_flags(flags, problems)
    except beast_flags.FlagError as e:
        raise UserError(str(e)) from None
    if checkpoint is not None:
        try:
            ckpt.check_compatible(checkpoint["flags"], flags)
        except ckpt.CheckpointError as e:
            raise UserError(str(e)) from None
    return run_dir, info, checkpoint


def build_model(flags, info):
    try:
        return models.create_model(flags, tuple(info["observation_shape"]), info["num_actions"])
    except ValueError as e:
        raise UserError(str(e)) from None


# ----------------------------------------------------------------------------
# Training.

def train(flags):
    run_dir, info, checkpoint = prepare(flags)
    torch.manual_seed(flags.seed)
    np.random.seed(flags.seed)
    torch.set_num_threads(flags.num_torch_threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not flags.disable_cuda
                          else "cpu")
    flags.device = str(device)

    actor_model = build_model(flags, info)
    learner_model = build_model(flags, info).to(device)
    optimizer, scheduler = learner.create_optimizer(flags, learner_model)
    step, episode_state = 0, None
    if checkpoint is not None:
        learner_model.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
        step = int(checkpoint["step"])
        episode_state = checkpoint.get("episodes")
        print(f"Resuming {run_dir.path} from step {step}.", file=sys.stderr)
    actor_model.load_state_dict(learner_model.state_dict())
    actor_model.share_memory()

    runlog.write_metadata(run_dir, flags)
    logger = runlog.StatsLogger(run_dir)
    trainer = Trainer(flags, run_dir, learner_model, actor_model, optimizer, scheduler,
                      logger, step=step, episode_state=episode_state)
    specs = rollout_specs(flags, info)
    buffers = create_buffers(flags, specs)
    state_buffers = create_state_buffers(actor_model, flags.num_buffers)

    status = None if flags.no_progress else runlog.StatusLine(flags.total_steps)
    stop = install_signal_handlers()
    evaluator = Evaluator(flags, info)
    try:
        if flags.num_actors == 0:
            train_serial(flags, trainer, buffers, state_buffers, device, status, evaluator, stop)
        else:
            train_parallel(flags, trainer, buffers, state_buffers, device, status, evaluator,
                           stop)
    finally:
        if status is not None:
            status.close()
        trainer.save()
        logger.close()
        evaluator.close()
    print(f"Trained to step {trainer.step}; mean episode return "
          f"{trainer.episodes.mean_return():.2f}. Run saved in {run_dir.path}", file=sys.stderr)
    return trainer


def train_parallel(flags, trainer, buffers, state_buffers, device, status, evaluator, stop):
    ctx = mp.get_context("fork")
    free_queue = ctx.SimpleQueue()
    full_queue = ctx.SimpleQueue()
    error_count = ctx.Value("i", 0)
    trainer.error_count = error_count
    actors = []
    for i in range(flags.num_actors):
        process = ctx.Process(target=act, name=f"actor-{i}", daemon=True,
                              args=(i, flags, free_queue, full_queue, trainer.actor_model,
                                    buffers, state_buffers, error_count))
        process.start()
        actors.append(process)
    for m in range(flags.num_buffers):
        free_queue.put(m)

    errors = []
    threads = [threading.Thread(target=learner_loop, name=f"learner-{i}", daemon=True,
                                args=(trainer, flags, full_queue, free_queue, buffers,
                                      state_buffers, device, errors))
               for i in range(flags.num_learner_threads)]
    for thread in threads:
        thread.start()
    last_checkpoint = time.time()
    try:
        while not trainer.done() and any(t.is_alive() for t in threads):
            time.sleep(0.2)
            if stop.is_set():
                print("\nStopping on request; the run can be resumed with "
                      f"--xpid {flags.xpid}.", file=sys.stderr)
                break
            for i, process in enumerate(actors):
                if process.exitcode not in (None, 0):
                    raise RuntimeError(f"Actor process {i} died with exit code "
                                       f"{process.exitcode}; its traceback is above.")
            if errors:
                raise errors[0]
            if status is not None:
                status.update(trainer.step, trainer.stats)
            if time.time() - last_checkpoint > flags.checkpoint_interval_s:
                trainer.save()
                last_checkpoint = time.time()
            evaluator.maybe_run(trainer)
        if errors:
            raise errors[0]
    finally:
        # Stop the actors first so no one waits on a queue that nobody feeds.
        for _ in range(flags.num_actors * flags.envs_per_actor):
            free_queue.put(None)
        for _ in threads:
            for _ in range(flags.batch_size):
                full_queue.put(None)
        for thread in threads:
            thread.join(timeout=60)
        for process in actors:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


def train_serial(flags, trainer, buffers, state_buffers, device, status, evaluator, stop):
    """Everything in this process and thread: step, learn, repeat."""
    sampler = Sampler(flags, trainer.actor_model, buffers, state_buffers, flags.batch_size,
                      seed=flags.seed * 100)
    free_queue, full_queue = queue.SimpleQueue(), queue.SimpleQueue()
    for m in range(flags.num_buffers):
        free_queue.put(m)
    last_checkpoint = time.time()
    try:
        while not trainer.done() and not stop.is_set():
            indices = [free_queue.get() for _ in range(flags.batch_size)]
            sampler.unroll(indices)
            for index in indices:
                full_queue.put(index)
            trainer.learn(*get_batch(flags, full_queue, free_queue, buffers, state_buffers,
                                     device))
            if status is not None:
                status.update(trainer.step, trainer.stats)
            if time.time() - last_checkpoint > flags.checkpoint_interval_s:
                trainer.save()
                last_checkpoint = time.time()
            evaluator.maybe_run(trainer)
    finally:
        sampler.close()


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


# ----------------------------------------------------------------------------
# Evaluation and testing.

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
    episodes on separate environments, logged apart from training episodes."""

    def __init__(self, flags, info):
        self.flags = flags
        self.info = info
        self.next_step = flags.eval_interval_steps
        self.model = None
        self.count = 0

    def maybe_run(self, trainer):
        if self.flags.eval_interval_steps <= 0 or trainer.step < self.next_step:
            return
        while self.next_step <= trainer.step:
            self.next_step += self.flags.eval_interval_steps
        if self.model is None:
            self.model = build_model(self.flags, self.info)
        with trainer.lock:
            self.model.load_state_dict(trainer.actor_model.state_dict())
            step = trainer.step
        self.count += 1
        returns = play_episodes(self.flags, self.model, self.flags.eval_episodes,
                                seed=10_000_000 + self.count)
        with trainer.lock:
            trainer.logger.log(step, {"eval_mean_episode_return": float(np.mean(returns)),
                                      "eval_episodes": len(returns)})

    def close(self):
        pass


def test(flags):
    run_dir, info, checkpoint = prepare(flags)
    torch.set_num_threads(flags.num_torch_threads)
    model = build_model(flags, info)
    model.load_state_dict(checkpoint["model_state_dict"])
    returns = play_episodes(flags, model, flags.test_episodes, seed=flags.seed + 12345)
    print(f"Played {len(returns)} episodes with the checkpoint of step {checkpoint['step']}: "
          f"mean return {np.mean(returns):.2f} (min {np.min(returns):.1f}, "
          f"max {np.max(returns):.1f}).")
    return returns


def main(argv=None):
    flags = parse_flags(argv)
    try:
        if flags.mode == "train":
            train(flags)
        else:
            test(flags)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
