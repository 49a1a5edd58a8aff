"""PolyBeast: the scalable IMPALA learner.

Data path:
  env servers (python -m polybeast_env; started here unless --no_start_servers)
    --gRPC streams--> libpolybeast.ActorPool (one C++ actor thread per stream)
    --compute((env_outputs, agent_state))--> inference_batcher --> inference threads
         (the acting model on [T=1, B, ...] batches; answer (agent_outputs, agent_state))
    --every unroll_length steps: (rollout [T+1, 1, ...], initial agent state) per
         environment (a stream may carry --envs_per_actor of them)--> learner_queue
    --batch_size rollouts concatenated along dim 1--> learner threads
         (V-trace loss, RMSprop; then new weights -> the acting model).

Everything around the learner step (flags, run directory, logs, checkpoints,
resume, evaluation, --mode test) is MonoBeast's, from beast/training.py.
Run `python -m polybeast --help` for the flags.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import torch

import libpolybeast
import polybeast_env
from beast import flags as beast_flags
from beast import learner
from beast import runlog
from beast import training

JOIN_TIMEOUT_S = 30
SERVER_STOP_TIMEOUT_S = 15
# Where the servers are belongs to this start of a run, not to the run: on a
# resume these flags are never taken from the saved flags.json.
PER_START_FLAGS = {"no_start_servers", "server_addresses", "pipes_basename"}


def make_parser():
    parser = argparse.ArgumentParser(
        description="PolyBeast: IMPALA with environment servers and a C++ actor pool.",
        formatter_class=beast_flags.HelpFormatter)
    beast_flags.add_common_flags(parser)
    # Environment servers and actors.
    parser.add_argument("--num_actors", type=int, default=4,
                        help="Actor threads, one gRPC stream and environment each; also the "
                             "number of env servers started here.")
    parser.add_argument("--envs_per_actor", type=int, default=None,
                        help="Environments behind each env server stream we start, stepped "
                             "together and sent as one batch (default: 2 Atari, 32 vector). "
                             "Servers started elsewhere choose it themselves (--envs_per_stream).")
    parser.add_argument("--pipes_basename", default=None,
                        help="Env server i listens at <pipes_basename>.i, a unix socket "
                             "(default: unix:<fresh temporary directory>/env, removed at exit).")
    parser.add_argument("--no_start_servers", action="store_true",
                        help="Connect to env servers started elsewhere with `python -m "
                             "polybeast_env` (at --server_addresses, or <pipes_basename>.i).")
    parser.add_argument("--server_addresses", default=None,
                        help="Comma-separated addresses of running env servers (unix:PATH or "
                             "HOST:PORT); actor i streams from address i mod their number. "
                             "Implies --no_start_servers.")
    parser.add_argument("--connect_timeout_s", type=float, default=60.0,
                        help="End the run when an env server cannot be reached for this long "
                             "(at the start, or after it went away).")
    # Inference and the learner queue.
    parser.add_argument("--num_inference_threads", type=int, default=1,
                        help="Threads that run the acting model on batches of actor requests.")
    parser.add_argument("--inference_batch_size", type=int, default=None,
                        help="Most actor requests in one inference forward pass "
                             "(default: num_actors).")
    parser.add_argument("--max_learner_queue_size", type=int, default=None,
                        help="Rollouts that may wait for the learner before the actors block; "
                             "a short queue keeps the policy lag small (default: batch_size).")
    return parser


# ----------------------------------------------------------------------------
# Flags.

def actor_addresses(flags):
    """The env server address of each actor thread (a list of num_actors strings)."""
    if flags.server_addresses:
        servers = [a.strip() for a in flags.server_addresses.split(",") if a.strip()]
    else:
        servers = [f"{flags.pipes_basename}.{i}" for i in range(flags.num_actors)]
    return [servers[i % len(servers)] for i in range(flags.num_actors)]


def inference_batch_size(flags):
    if flags.inference_batch_size is None:
        return max(1, flags.num_actors)
    return flags.inference_batch_size


def learner_queue_size(flags):
    if flags.max_learner_queue_size is None:
        return flags.batch_size
    return flags.max_learner_queue_size


def variant_defaults(flags, info):
    """Checks PolyBeast's own flags; returns the problems found.

    inference_batch_size and max_learner_queue_size stay None when not given
    (see the two functions above), so that a resume with another --num_actors
    or --batch_size does not inherit sizes derived from the old ones.
    """
    if flags.server_addresses:
        flags.no_start_servers = True
        servers = [a.strip() for a in flags.server_addresses.split(",") if a.strip()]
        if "num_actors" not in flags.given and servers:
            flags.num_actors = len(servers)
    if flags.envs_per_actor is None:
        # Measured on 2 cores, Pong, B=8, T=80, 4 servers (a loaded machine): 1 env per
        # stream 490 SPS, 2 envs 583; CartPole: 1 env 3,400 SPS, 32 envs ~30,000.
        flags.envs_per_actor = 2 if info["is_atari"] else 32
    problems = []
    if flags.envs_per_actor < 1:
        problems.append(f"--envs_per_actor must be at least 1 (got {flags.envs_per_actor}).")
    if flags.mode != "train":
        return problems  # --mode test plays locally: no servers, no queues.
    if flags.num_torch_threads is None and not flags.no_start_servers:
        # The env servers we start share this machine's cores with the
        # learner. Leaving them a core each (as far as there are cores) was
        # faster on two cores: Pong, 4 servers, batch 8, unroll 80: ~790 SPS
        # with one intra-op thread, ~725 with two (OpenMP threads spinning
        # while the servers wait for a core).
        flags.num_torch_threads = max(1, beast_flags.default_num_torch_threads()
                                      - flags.num_actors)
    if flags.num_actors < 1:
        problems.append(f"--num_actors must be at least 1 (got {flags.num_actors}).")
    if flags.num_inference_threads < 1:
        problems.append(f"--num_inference_threads must be at least 1 "
                        f"(got {flags.num_inference_threads}).")
    if flags.inference_batch_size is not None and flags.inference_batch_size < 1:
        problems.append(f"--inference_batch_size must be at least 1 "
                        f"(got {flags.inference_batch_size}).")
    if learner_queue_size(flags) < flags.batch_size:
        # The queue hands out batch_size rollouts at once: a shorter one never fills.
        problems.append(f"--max_learner_queue_size ({flags.max_learner_queue_size}) must be at "
                        f"least --batch_size ({flags.batch_size}).")
    if not flags.connect_timeout_s > 0:
        problems.append(f"--connect_timeout_s must be positive (got {flags.connect_timeout_s}).")
    if flags.server_addresses is not None:
        servers = [a.strip() for a in flags.server_addresses.split(",") if a.strip()]
        if not servers:
            problems.append("--server_addresses is empty: give unix:PATH or HOST:PORT, "
                            "comma-separated.")
        for address in servers:
            if not address.startswith("unix:"):
                try:
                    polybeast_env.is_loopback(address)
                except ValueError:
                    problems.append(f"--server_addresses: {address!r} is neither unix:PATH "
                                    "nor HOST:PORT.")
    elif flags.no_start_servers and flags.pipes_basename is None:
        problems.append("--no_start_servers needs --server_addresses (or --pipes_basename) to "
                        "know where the env servers listen.")
    if flags.pipes_basename is not None and not flags.pipes_basename.startswith("unix:"):
        problems.append(f"--pipes_basename must start with 'unix:' (got "
                        f"{flags.pipes_basename!r}); use --server_addresses HOST:PORT,... "
                        "for TCP.")
    elif flags.pipes_basename is not None and not flags.no_start_servers:
        directory = os.path.dirname(flags.pipes_basename[len("unix:"):]) or "."
        if not os.path.isdir(directory):
            problems.append(f"--pipes_basename: the directory {directory} does not exist.")
    return problems


# ----------------------------------------------------------------------------
# Environment servers started by this process.

class LocalEnvServers:
    """`python -m polybeast_env` as a child process serving num_servers unix sockets.

    It runs in its own session, so a Ctrl-C meant for the learner does not stop
    the servers before the learner has closed its queues; --exit_with_parent
    makes it stop if this process dies without cleaning up (SIGKILL, OOM).
    """

    def __init__(self, flags, num_servers):
        self.flags = flags
        self.num_servers = num_servers
        self.own_dir = None
        if flags.pipes_basename is None:
            self.own_dir = tempfile.mkdtemp(prefix=f"polybeast-{os.getpid()}-")
            self.pipes_basename = f"unix:{self.own_dir}/env"
        else:
            self.pipes_basename = flags.pipes_basename
        self.addresses = [f"{self.pipes_basename}.{i}" for i in range(num_servers)]
        self.process = None

    def start(self):
        flags = self.flags
        command = [
            sys.executable, "-m", "polybeast_env",
            "--env", flags.env,
            "--env_backend", flags.env_backend,
            "--episodic_life" if flags.episodic_life else "--no-episodic_life",
            "--seed", str(flags.seed),
            "--num_servers", str(self.num_servers),
            "--envs_per_stream", str(flags.envs_per_actor),
            "--pipes_basename", self.pipes_basename,
            "--exit_with_parent",
        ]
        env = dict(os.environ)
        # polybeast_env and beast/ sit beside this file, wherever we are run from.
        code_dir = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (code_dir, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(command, env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL)
        return self

    def exit_code(self):
        """None while the servers run."""
        return None if self.process is None else self.process.poll()

    def wait_until_listening(self, timeout_s, stop):
        """Blocks until every socket exists or `stop` is set. Raises UserError if the
        servers exit or do not listen within timeout_s."""
        paths = [a[len("unix:"):] for a in self.addresses]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(p) for p in paths) and not stop.is_set():
            code = self.exit_code()
            if code is not None:
                raise training.UserError(
                    f"the env servers (python -m polybeast_env) exited with status {code} "
                    "before listening; their message is above.")
            if time.monotonic() > deadline:
                missing = [p for p in paths if not os.path.exists(p)]
                raise training.UserError(
                    f"the env servers did not listen within --connect_timeout_s "
                    f"{timeout_s:g} s (no socket at {', '.join(missing)}).")
            time.sleep(0.05)

    def stop(self):
        """Stops the servers and removes our socket directory; idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # polybeast_env stops its servers and exits
            try:
                self.process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"warning: the env servers (pid {self.process.pid}) did not stop within "
                      f"{SERVER_STOP_TIMEOUT_S} s; killing them.", file=sys.stderr)
                self.process.kill()
                self.process.wait(SERVER_STOP_TIMEOUT_S)
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None


# ----------------------------------------------------------------------------
# Acting.

class InferenceModels:
    """The acting model: one replica per inference thread, each behind its own lock.

    Trainer.learn calls load_state_dict after every step. A forward pass holds
    its replica's lock, so it never sees weights half-way through a copy, and
    the copy waits at most one small forward pass. One replica per thread
    keeps the inference threads from waiting on each other.
    """

    def __init__(self, replicas):
        self.replicas = list(replicas)
        self.locks = [threading.Lock() for _ in self.replicas]

    def load_state_dict(self, state_dict):
        for replica, lock in zip(self.replicas, self.locks):
            with lock:
                replica.load_state_dict(state_dict)

    def forward(self, index, inputs, core_state):
        with self.locks[index], torch.no_grad():
            return self.replicas[index](inputs, core_state)


def to_torch(array, device):
    """A numpy array (owned by the C++ side, or a view of one) as a tensor on device.

    On the CPU this is torch.from_numpy: no copy. Towards a GPU the data goes
    through pinned memory so the copy can run asynchronously.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def inference(index, inference_batcher, models, device, errors):
    """Inference thread: answers batches of actor requests until the batcher closes.

    A batch holds one step of B actors: env_outputs arrays are [T=1, B, ...]
    and the agent state arrays [layers, B, hidden]. obs[t] -> action[t].
    """
    try:
        for batch in inference_batcher:
            env_outputs, agent_state = batch.get_inputs()
            inputs = {k: to_torch(v, device) for k, v in env_outputs.items()}
            state = tuple(to_torch(s, device) for s in agent_state)
            outputs, state = models.forward(index, inputs, state)
            # The only device-to-host copy (and sync point) of an inference step.
            agent_outputs = {k: outputs[k].cpu().numpy() for k in learner.AGENT_KEYS}
            batch.set_outputs((agent_outputs, tuple(s.cpu().numpy() for s in state)))
    except Exception as e:  # Reported by the main thread, which stops the run.
        traceback.print_exc()
        errors.append(e)
        inference_batcher.close()


def run_actor_pool(actor_pool, errors):
    try:
        actor_pool.run()
    except Exception as e:  # The first actor's error; it also closed the queues.
        errors.append(e)


# ----------------------------------------------------------------------------
# Learning.

def learn(flags, learner_queue, trainer, device, errors):
    """Learner thread: batches [T+1, B, ...] from the learner queue -> trainer.learn."""
    try:
        for rollouts, initial_agent_state in learner_queue:
            if trainer.done():
                return
            batch = {k: to_torch(v, device) for k, v in rollouts.items()}
            # The state before step 0 of each rollout: [layers, B, hidden].
            state = tuple(to_torch(s, device) for s in initial_agent_state)
            trainer.learn(batch, state)
    except Exception as e:  # Reported by the main thread, which stops the run.
        traceback.print_exc()
        errors.append(e)


# ----------------------------------------------------------------------------
# Training.

def train(flags):
    run_dir, info, checkpoint = training.prepare(flags, variant_defaults)
    torch.manual_seed(flags.seed)
    np.random.seed(flags.seed)
    # The learner step and the inference forward passes run in this one
    # process and share its intra-op threads (--num_torch_threads, set once:
    # PyTorch's thread count is per process, not per Python thread; see
    # variant_defaults for the default). The inference batches are small
    # ([1, B], B <= inference_batch_size) and gain little from more threads;
    # the learner step is what the threads are for.
    torch.set_num_threads(flags.num_torch_threads)
    # Before anything slow: a SIGTERM or Ctrl-C from now on stops the run
    # through the finally blocks below, which also stop the env servers.
    stop = training.install_signal_handlers()
    servers = None if flags.no_start_servers else LocalEnvServers(flags, flags.num_actors)
    try:
        if servers is not None:
            servers.start()  # they start up while we build the models
            addresses = servers.addresses
        else:
            addresses = actor_addresses(flags)
            remote = sorted({a for a in addresses if not polybeast_env.is_loopback(a)})
            if remote:
                print(f"warning: the env servers at {', '.join(remote)} are reached over the "
                      "network; the traffic is neither authenticated nor encrypted.",
                      file=sys.stderr)
        runlog.write_metadata(run_dir, flags)
        logger = runlog.StatsLogger(run_dir)
        trainer = training.create_learner(flags, info, run_dir, checkpoint, logger)
        device = torch.device(flags.device)
        replicas = []
        for _ in range(flags.num_inference_threads):
            replica = training.build_model(flags, info).to(device)
            replica.load_state_dict(trainer.model.state_dict())
            replicas.append(replica)
        trainer.actor_model = InferenceModels(replicas)
        status = None if flags.no_progress else runlog.StatusLine(flags.total_steps)
        evaluator = training.Evaluator(flags, info, trainer)
        try:
            if servers is not None:
                servers.wait_until_listening(flags.connect_timeout_s, stop)
            if stop.is_set():
                print("Stopping on request before training started.", file=sys.stderr)
            else:
                train_loop(flags, trainer, replicas[0], addresses, servers, device, status,
                           evaluator, stop)
                evaluator.maybe_run(trainer)  # The last snapshot, if training outran it.
        finally:
            if servers is not None:
                servers.stop()
            if status is not None:
                status.close()
            trainer.save()
            logger.close()
    finally:
        if servers is not None:
            servers.stop()  # also when the set-up above failed
    print(f"Trained to step {trainer.step}; mean episode return "
          f"{trainer.episodes.mean_return():.2f}. Run saved in {run_dir.path}", file=sys.stderr)
    return trainer


def train_loop(flags, trainer, model, addresses, servers, device, status, evaluator, stop):
    """Runs actors, inference and learner threads until total_steps or a stop."""
    learner_queue = libpolybeast.BatchingQueue(
        batch_dim=1, minimum_batch_size=flags.batch_size, maximum_batch_size=flags.batch_size,
        maximum_queue_size=learner_queue_size(flags))
    # Minimum 1: a batch is whatever requests came in during the previous
    # forward pass, so no actor waits for others to catch up.
    inference_batcher = libpolybeast.DynamicBatcher(
        batch_dim=1, minimum_batch_size=1, maximum_batch_size=inference_batch_size(flags))
    # The agent state of one actor has batch dim 1: [layers, 1, hidden].
    initial_agent_state = tuple(s.numpy() for s in model.initial_state(1))
    actor_pool = libpolybeast.ActorPool(
        unroll_length=flags.unroll_length, learner_queue=learner_queue,
        inference_batcher=inference_batcher, env_server_addresses=addresses,
        initial_agent_state=initial_agent_state, connect_timeout_s=flags.connect_timeout_s)

    pool_errors, errors = [], []
    pool_thread = threading.Thread(target=run_actor_pool, name="actor-pool", daemon=True,
                                   args=(actor_pool, pool_errors))
    threads = [threading.Thread(target=inference, name=f"inference-{i}", daemon=True,
                                args=(i, inference_batcher, trainer.actor_model, device,
                                      errors))
               for i in range(flags.num_inference_threads)]
    threads += [threading.Thread(target=learn, name=f"learner-{i}", daemon=True,
                                 args=(flags, learner_queue, trainer, device, errors))
                for i in range(flags.num_learner_threads)]
    learner_threads = threads[flags.num_inference_threads:]
    for thread in [pool_thread] + threads:
        thread.start()
    try:
        while not trainer.done():
            time.sleep(0.2)
            if stop.is_set():
                print("\nStopping on request; the run can be resumed with "
                      f"--xpid {flags.xpid}.", file=sys.stderr)
                break
            # Read before the error lists: a thread records its error before it ends.
            pool_ended = not pool_thread.is_alive()
            learners_ended = not any(t.is_alive() for t in learner_threads)
            if pool_errors:
                raise training.UserError(
                    f"{pool_errors[0]}\nThe actors stream from {', '.join(sorted(set(addresses)))}"
                    "; start env servers there (python -m polybeast_env) or check "
                    "--server_addresses / --pipes_basename.")
            if errors:
                raise errors[0]
            if servers is not None and servers.exit_code() is not None:
                raise training.UserError(
                    f"the env servers (python -m polybeast_env) exited with status "
                    f"{servers.exit_code()}; their message is above.")
            if pool_ended or learners_ended:
                if trainer.done():
                    break
                raise RuntimeError("the actor pool or the learner threads ended unexpectedly.")
            trainer.housekeeping(status, evaluator)
    finally:
        # Closing the queues wakes every thread: actors blocked in compute()
        # or enqueue(), the inference threads and the learner threads.
        learner_queue.close()
        inference_batcher.close()
        actor_pool.close()
        for thread in [pool_thread] + threads:
            thread.join(timeout=JOIN_TIMEOUT_S)
            if thread.is_alive():
                print(f"warning: thread {thread.name} did not stop within {JOIN_TIMEOUT_S} s.",
                      file=sys.stderr)


# ----------------------------------------------------------------------------
# Testing and the command line.

def parse_flags(argv=None):
    return training.parse_flags(make_parser(), argv, always_given=PER_START_FLAGS)


def test(flags):
    return training.test(flags, variant_defaults)


def main(argv=None):
    return training.run_main(parse_flags(argv), train, test)


if __name__ == "__main__":
    sys.exit(main())
