"""PolyBeast: the scalable IMPALA learner.

Data path:
  env servers (python -m polybeast_env; started here unless --no_start_servers)
    --streams (gRPC; raw messages on unix sockets to the servers started here)-->
         libpolybeast.ActorPool
         (one C++ actor thread per stream)
    --compute((env_outputs, agent_state))--> inference_batcher --> inference threads
         (the acting model on [T=1, B, ...] batches; answer (agent_outputs, agent_state))
    --every unroll_length steps: (rollout [T+1, 1, ...], initial agent state) per
         environment (a stream may carry --envs_per_stream of them)--> learner_queue
    --batch_size rollouts concatenated along dim 1--> learner threads
         (V-trace loss, RMSprop; then new weights -> the acting model).

The actor pool, the batcher and the inference threads run in a process of their own
(ActingProcess), forked from a CPU learner, spawned beside a CUDA one (a fork cannot use
CUDA), where inference stays on the GPU. Its batches reach the learner through shared
memory, and the learner writes the acting model's weights into the acting process's replicas
(shared memory, or GPU memory shared through CUDA IPC).

Everything around the actors (flags, run directory, learner, logs, checkpoints,
resume, evaluation, --mode test) is the run skeleton MonoBeast shares, in
beast/training.py.
Run `python -m polybeast --help` for the flags.
"""

import argparse
import contextlib
import functools
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from torch import multiprocessing as mp

import libpolybeast
from beast import distributed
from beast import restarts
from beast import flags as beast_flags
from beast import models as beast_models  # the name models is the InferenceModels below
from beast import rollout
from beast import tls
from beast import system
from beast import training

JOIN_TIMEOUT_S = 30
SERVER_STOP_TIMEOUT_S = 15
# Where the servers are belongs to this start of a run, not to the run: on a
# resume these flags are never taken from the saved flags.json.
# So are the TLS files, which live on the machine that starts it.
PER_START_FLAGS = frozenset({"no_start_servers", "server_addresses", "pipes_basename",
                             "tls_ca", "tls_cert", "tls_key", "tls_server_name"})
# Environments behind each server stream, by kind of environment (beast/flags.py ENV_DEFAULTS).
# On Atari, more streams with fewer environments spread the servers' stepping over the cores.
# Vector tasks: many, so that each stream amortizes its round trip (gRPC, inference) over more
# environments; not more, since every environment in flight adds to the policy lag, which
# slows learning (docs/defaults.md).
ENVS_PER_STREAM = {"atari": 2, "image": 32, "vector": 64, "continuous": 16}
# The env servers started here, by default: one per core, at most this many, hosting
# DEFAULT_NUM_ACTORS x ENVS_PER_STREAM environments in all. With fewer cores than servers,
# the extra processes only take turns, so fewer servers carry more environments each.
DEFAULT_NUM_ACTORS = 4
# The acting process is forked, as MonoBeast's actors are: it starts at once and inherits
# the acting model's shared memory. (No gRPC runs in this process before it.) Beside a CUDA
# learner it is spawned: a forked child cannot use CUDA, and a spawned one receives the
# replicas' GPU memory through CUDA IPC (torch.multiprocessing), so inference stays there.
FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")
ACTING_START_METHODS = {"fork": FORK, "spawn": SPAWN}


def make_parser():
    parser = argparse.ArgumentParser(
        description="PolyBeast: IMPALA with environment servers and a C++ actor pool.",
        formatter_class=beast_flags.HelpFormatter)
    beast_flags.add_common_flags(parser)
    _add_server_flags(parser)
    # Inference and the learner queue.
    parser.add_argument("--num_inference_threads", type=beast_flags.Number(int, low=1), default=1,
                        help="Threads that run the acting model on batches of actor requests.")
    parser.add_argument("--inference_torch_threads", type=beast_flags.Number(int, low=1), default=1,
                        help="Intra-op threads of each inference thread (the learner threads "
                             "keep --num_torch_threads). One: a batch of single steps is too "
                             "small to split.")
    parser.add_argument("--acting_start_method", choices=sorted(ACTING_START_METHODS),
                        default=None,
                        help="How the acting process starts: fork (the default with the "
                             "learner on the CPU: it starts at once) or spawn (the default with "
                             "a CUDA learner, whose fork could not use CUDA).")
    parser.add_argument("--inference_batch_size", type=beast_flags.Number(int, low=1), default=None,
                        help="Most actor requests in one inference forward pass "
                             "(default: num_actors).")
    # Several learner ranks (torchrun; beast/distributed.py).
    parser.add_argument("--dist_timeout_s", type=beast_flags.Number(float, above=0), default=300.0,
                        help="Under torchrun: end the run when another learner rank sends no "
                             "heartbeat, or a gradient all-reduce waits, for this long (a rank "
                             "that crashed is usually noticed at once).")
    parser.add_argument("--max_learner_queue_size", type=beast_flags.Number(int, low=1),
                        default=None,
                        help="Rollouts that may wait for the learner before the actors block; "
                             "a short queue keeps the policy lag small (default: batch_size).")
    tls.add_learner_flags(parser)
    return parser


def _add_server_flags(parser):
    """Where the env servers are, how many, and how their streams are laid out."""
    parser.add_argument("--num_actors", type=beast_flags.Number(int, low=1), default=None,
                        help="Actor threads, one env server stream each (a stream carries "
                             "--envs_per_stream environments); also the number of env servers "
                             f"started here (default: one per core, at most {DEFAULT_NUM_ACTORS}; "
                             "one per address of --server_addresses).")
    parser.add_argument("--envs_per_stream",
                        type=beast_flags.Number(int, 1, libpolybeast.MAX_ENVS_PER_STREAM),
                        default=None,
                        help="Environments behind each env server stream, stepped together and "
                             "sent as one batch (default: "
                             f"{beast_flags.describe_defaults(ENVS_PER_STREAM)}; with fewer than "
                             f"{DEFAULT_NUM_ACTORS} servers, started here or at "
                             "--server_addresses, and --num_actors left to its default, as "
                             "many more as keeps the environments in all the same). The servers "
                             "started here get it as a flag; the actors ask servers started "
                             "elsewhere for it when they open a stream, which those follow unless "
                             "started with their own --envs_per_stream.")
    parser.add_argument("--pipes_basename", default=None,
                        help="Env server i listens at <pipes_basename>.i, a unix socket: "
                             "unix:PATH for gRPC, raw:PATH for the same messages without gRPC "
                             "(default: raw:<fresh temporary directory>/env, removed at exit). "
                             "The servers started here speak raw messages unless it says "
                             "unix:.")
    parser.add_argument("--no_start_servers", action="store_true",
                        help="Connect to env servers started elsewhere with `python -m "
                             "polybeast_env` (at --server_addresses, or <pipes_basename>.i).")
    parser.add_argument("--server_addresses", default=None,
                        help="Comma-separated addresses of running env servers (unix:PATH, "
                             "raw:PATH or HOST:PORT); actor i streams from address i mod their "
                             "number. Implies --no_start_servers.")
    parser.add_argument("--connect_timeout_s", type=beast_flags.Number(float, above=0),
                        default=60.0,
                        help="End the run when an env server cannot be reached for this long "
                             "(at the start, or after it went away), or when its streams keep "
                             "ending before a rollout is complete for this long.")
    parser.add_argument("--stream_timeout_s", type=beast_flags.Number(float, above=0), default=30.0,
                        help="Cancel a stream and reconnect when its env server sends no step "
                             "for this long (a server that went silent). Only the wait for the "
                             "server counts, not inference or the learner queue: set it above "
                             "the slowest environment step (with --envs_per_stream, the whole "
                             "batch's).")


# ----------------------------------------------------------------------------
# Flags.

def server_list(flags):
    """The env servers' addresses: this learner rank's share of --server_addresses (all of
    them with one learner), or <pipes_basename>.i for each actor."""
    if flags.server_addresses is not None:
        rank, world_size = distributed.env_rank()
        return distributed.shard(beast_flags.parse_address_list(flags.server_addresses),
                                 rank, world_size)
    return [f"{flags.pipes_basename}.{i}" for i in range(flags.num_actors)]


def actor_addresses(flags, servers):
    """The env server address of each actor thread: actor i streams from server i mod n."""
    return [servers[i % len(servers)] for i in range(flags.num_actors)]


def inference_batch_size(flags):
    if flags.inference_batch_size is None:
        return max(1, flags.num_actors)
    return flags.inference_batch_size


def default_layout(flags, kind):
    """Fills --num_actors and --envs_per_stream where not given (a resume keeps its own).

    One actor per server: one server per core started here (at most DEFAULT_NUM_ACTORS), or
    one per address of --server_addresses (this rank's share). Their streams carry
    ENVS_PER_STREAM[kind] environments each, or more when there are fewer than
    DEFAULT_NUM_ACTORS servers, so that at least DEFAULT_NUM_ACTORS x ENVS_PER_STREAM[kind]
    environments are in flight: servers started by hand get the layout of the ones started
    here. An explicit --num_actors gets ENVS_PER_STREAM[kind] per stream.
    """
    local = flags.server_addresses is None and not flags.no_start_servers
    chosen = flags.num_actors is None
    if chosen:
        if local:
            flags.num_actors = min(DEFAULT_NUM_ACTORS, beast_flags.default_num_torch_threads())
        else:
            flags.num_actors = _address_count(flags) or DEFAULT_NUM_ACTORS
    if flags.envs_per_stream is None:
        flags.envs_per_stream = ENVS_PER_STREAM[kind]
        if chosen:
            total = DEFAULT_NUM_ACTORS * ENVS_PER_STREAM[kind]
            flags.envs_per_stream = max(flags.envs_per_stream, total // flags.num_actors)


def _address_count(flags):
    """This rank's number of --server_addresses; None without them, or when they do not parse
    (_check_servers reports that)."""
    if flags.server_addresses is None:
        return None
    try:
        return len(server_list(flags))
    except ValueError:
        return None


def learner_queue_size(flags):
    """batch_size by default. A stream hands its envs_per_stream rollouts over at once, so a
    short queue blocks its actor thread until the learner has taken the rest. A longer
    queue (room for two rounds of every stream's unroll, as MonoBeast's --num_buffers) does
    not make a run faster, and it lengthens the policy lag."""
    if flags.max_learner_queue_size is None:
        return flags.batch_size
    return flags.max_learner_queue_size


def check_flags(flags, info):
    """PolyBeast's own env-dependent flags; returns the problems found.

    inference_batch_size and max_learner_queue_size stay None when not given (see
    inference_batch_size and learner_queue_size), so that a resume with another
    --num_actors or --batch_size does not inherit sizes derived from the old ones.
    """
    default_layout(flags, info["kind"])
    # --envs_per_stream's range also holds for servers started elsewhere: the actors ask
    # them for it (create_actor_pool).
    problems = beast_flags.range_problems(flags, make_parser())
    if flags.mode != "train":
        return problems  # --mode test plays locally: no servers, no queues.
    problems += _check_servers(flags) or _check_tls(flags)
    if flags.num_torch_threads is None and not flags.no_start_servers:
        flags.num_torch_threads = beast_flags.default_num_torch_threads(flags.num_actors)
    if learner_queue_size(flags) < flags.batch_size:
        # The queue hands out batch_size rollouts at once: a shorter one never fills.
        problems.append(f"--max_learner_queue_size ({flags.max_learner_queue_size}) must be at "
                        f"least --batch_size ({flags.batch_size}).")
    return problems


def _check_servers(flags):
    """Checks where the env servers are; --server_addresses implies --no_start_servers and,
    unless --num_actors was given, one actor per address."""
    if flags.server_addresses is not None:
        flags.no_start_servers = True
        try:
            servers = server_list(flags)
        except ValueError as e:
            return [f"--server_addresses: {e}"]
        if not servers:
            return [f"--server_addresses gives fewer addresses than the "
                    f"{distributed.env_rank()[1]} learner ranks: each rank needs its own."]
        if "num_actors" not in flags.given:
            flags.num_actors = len(servers)
    elif flags.no_start_servers and flags.pipes_basename is None:
        return ["--no_start_servers needs --server_addresses (or --pipes_basename) to know "
                "where the env servers listen."]
    if flags.pipes_basename is not None and not beast_flags.socket_path(flags.pipes_basename):
        return [f"--pipes_basename must be unix:PATH or raw:PATH (got {flags.pipes_basename!r}); "
                "use --server_addresses HOST:PORT,... for TCP."]
    if flags.pipes_basename is not None and flags.server_addresses is None:
        basename = flags.pipes_basename
        if not flags.no_start_servers:
            basename = rank_basename(basename, *distributed.env_rank())  # LocalEnvServers'
        problem = beast_flags.socket_path_problem(f"{basename}.{max(flags.num_actors - 1, 0)}")
        if problem:
            return [f"--pipes_basename: {problem}."]
    if flags.pipes_basename is not None and not flags.no_start_servers:
        directory = os.path.dirname(beast_flags.socket_path(flags.pipes_basename)) or "."
        if not os.path.isdir(directory):
            return [f"--pipes_basename: the directory {directory} does not exist."]
    return []


def _check_tls(flags):
    """TLS is for env servers on other machines: HOST:PORT addresses of --server_addresses."""
    try:
        config = tls.learner_config(flags)
    except ValueError as e:
        return [str(e)]
    if config is None:
        return []
    if flags.server_addresses is None:
        return ["--tls_ca is for env servers started elsewhere (--server_addresses HOST:PORT,...); "
                "the servers this learner starts listen on unix sockets on this machine."]
    sockets = [a for a in beast_flags.parse_address_list(flags.server_addresses)
               if beast_flags.socket_path(a)]
    if sockets:
        return [f"--tls_ca is for HOST:PORT addresses; {sockets[0]} is a unix socket on this "
                "machine."]
    return []


# ----------------------------------------------------------------------------
# Environment servers started by this process.

def rank_basename(pipes_basename, rank, world_size):
    """The --pipes_basename of this rank's own servers: learner ranks on one host must not
    share sockets, so each of several gets its own suffix."""
    return f"{pipes_basename}-rank{rank}" if world_size > 1 else pipes_basename


def socket_dir(num_servers):
    """Where a run's own server sockets go: the temporary directory ($TMPDIR), unless its
    path is too long for a unix socket (a cluster's per-job scratch can be), then /tmp."""
    longest = os.path.join(tempfile.gettempdir(), f"polybeast-{os.getpid()}-xxxxxxxx",
                           f"env.{num_servers - 1}")
    if len(os.fsencode(longest)) > beast_flags.MAX_SOCKET_PATH_BYTES:
        return "/tmp"
    return None


class LocalEnvServers:
    """`python -m polybeast_env` as a child process serving num_servers unix sockets.

    It runs in its own session, so a Ctrl-C meant for the learner does not stop
    the servers before the learner has closed its queues; --exit_with_parent
    makes it stop if this process dies without cleaning up (SIGKILL, OOM). If it
    is killed itself while serving, it is started again (beast/restarts.py), once
    what is left of its session (servers it could not stop) is gone.
    """

    def __init__(self, flags, num_servers):
        self.flags = flags
        self.num_servers = num_servers
        self.own_dir = None
        self.rank, world_size = distributed.env_rank()
        if flags.pipes_basename is None:
            self.own_dir = tempfile.mkdtemp(prefix=f"polybeast-{os.getpid()}-",
                                            dir=socket_dir(num_servers))
            # Raw messages on a unix socket: the actor threads read and write them
            # themselves, with fewer hand-offs per round trip than gRPC's.
            self.pipes_basename = f"raw:{self.own_dir}/env"
        else:
            self.pipes_basename = rank_basename(flags.pipes_basename, self.rank, world_size)
        self.addresses = [f"{self.pipes_basename}.{i}" for i in range(num_servers)]
        self.process = None
        self.policy = restarts.RestartPolicy()

    def start(self):
        flags = self.flags
        command = [
            sys.executable, "-m", "polybeast_env",
            *beast_flags.env_flag_args(flags),  # the same environment as the learner's
            # Each learner rank's environments their own seeds (rank 0 keeps --seed).
            "--seed", str(distributed.rank_seed(flags.seed, self.rank)),
            "--num_servers", str(self.num_servers),
            "--envs_per_stream", str(flags.envs_per_stream),
            "--pipes_basename", self.pipes_basename,
            # An environment hung for as long as the actor waits is killed and restarted.
            "--step_timeout_s", str(flags.stream_timeout_s),
            "--exit_with_parent",
        ]
        env = dict(os.environ)
        # polybeast_env and beast/ sit beside this file, wherever we are run from.
        code_dir = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (code_dir, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(command, env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL)
        self.started = time.monotonic()
        return self

    def exit_code(self):
        """None while the servers run."""
        return None if self.process is None else self.process.poll()

    def wait_until_listening(self, timeout_s, stop):
        """Blocks until every socket exists or `stop` is set. Raises UserError if the
        servers exit or do not listen within timeout_s."""
        paths = [beast_flags.socket_path(a) for a in self.addresses]
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

    def check(self):
        """Starts polybeast_env again if a signal killed it while it served (the OOM killer);
        raises UserError if it exited by itself (a server that never came up: its message is
        above) or keeps dying."""
        code = self.exit_code()
        if code is None:
            return
        ran = time.monotonic() - self.started
        why_not = (self.policy.why_not(ran) if code < 0 else
                   "it stopped by itself")
        if why_not is not None:
            raise training.UserError(
                f"the env servers (python -m polybeast_env) exited with status {code} "
                f"({why_not}); their message is above.")
        print(f"warning: the env servers (python -m polybeast_env) exited with status {code} "
              f"after {ran:.0f} s; starting them again (restart {self.policy.restarts}).",
              file=sys.stderr, flush=True)
        self._stop_session()  # servers of the dead one must free their addresses first
        self.start()

    def _stop_session(self):
        """Ends every process left in polybeast_env's session (its process group): the
        servers of one that was killed before it could stop them. SIGTERM, then SIGKILL
        after SERVER_STOP_TIMEOUT_S."""
        deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                while time.monotonic() < deadline:
                    time.sleep(0.05)
                    os.killpg(self.process.pid, 0)  # raises once the group is empty
            except ProcessLookupError:
                return
            deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
        print(f"warning: processes of the env servers' group {self.process.pid} outlived "
              "SIGKILL.", file=sys.stderr)

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
        if self.process is not None:
            self._stop_session()  # nothing of theirs outlives the run
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None


@contextlib.contextmanager
def environments(flags):
    """The env servers this run starts (None with --no_start_servers); stopped at exit."""
    if flags.mode != "train" or flags.no_start_servers:
        yield None
        return
    servers = LocalEnvServers(flags, flags.num_actors)
    try:
        yield servers.start()  # they boot while the learner builds its models
    finally:
        servers.stop()


# ----------------------------------------------------------------------------
# Acting.

class InferenceModels:
    """The acting model: one replica per inference thread, each behind its own lock.

    The learner calls load_state_dict after every step. A forward pass holds
    its replica's lock, so it never sees weights half-way through a copy, and
    the copy waits at most one small forward pass. One replica per thread
    keeps the inference threads from waiting on each other. context: the multiprocessing
    context of an ActingProcess, whose replicas are then in shared memory (or shared GPU
    memory) and whose locks work across processes.
    """

    def __init__(self, replicas, context=None):
        self.replicas = list(replicas)
        self.context = context  # of the acting process; None: threads of this process only
        for replica in self.replicas:
            # GPU memory needs nothing: a spawned child gets it through CUDA IPC as it is.
            if context is not None and next(replica.parameters()).device.type == "cpu":
                replica.share_memory()
        self.abandoned = threading.Event()
        self.renew_locks()

    def renew_locks(self):
        """Fresh locks: after an acting process died, perhaps holding one."""
        make_lock = threading.Lock if self.context is None else self.context.Lock
        self.locks = [make_lock() for _ in self.replicas]
        self.abandoned.clear()

    def __getstate__(self):
        """What a spawned acting process receives: the replicas (shared) and the locks; the
        learner's own bookkeeping stays here."""
        state = dict(self.__dict__)
        del state["abandoned"], state["context"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, abandoned=threading.Event(), context=None)

    def abandon(self):
        """The process that used the locks is gone: writers stop waiting on them (its
        replacement gets renew_locks and the weights again)."""
        self.abandoned.set()

    def load_state_dict(self, state_dict):
        for replica, lock in zip(self.replicas, self.locks):
            if not self._acquire(lock):
                continue
            try:
                replica.load_state_dict(state_dict)
            finally:
                lock.release()

    def _acquire(self, lock):
        """Takes lock; False if abandon() is called while waiting."""
        while not lock.acquire(timeout=0.1):
            if self.abandoned.is_set():
                return False
        return True

    def forward(self, index, inputs, core_state):
        with self.locks[index]:
            return beast_models.act(self.replicas[index], inputs, core_state)


def acting_context(flags, device):
    """The multiprocessing context that starts the acting process (--acting_start_method)."""
    if flags.acting_start_method is not None:
        return ACTING_START_METHODS[flags.acting_start_method]
    return FORK if device.type == "cpu" else SPAWN


def acting_model(flags, info, model):
    """One replica of the model per inference thread, on the learner's device, in
    --acting_precision."""
    device = next(model.parameters()).device
    context = acting_context(flags, device)
    if context is FORK and device.type != "cpu":
        raise training.UserError(
            f"--acting_start_method fork with the learner on {device}: a forked process "
            "cannot use CUDA. Drop --acting_start_method (a CUDA learner spawns it), or add "
            "--disable_cuda.")
    return InferenceModels((training.build_acting_model(flags, info, device)
                            for _ in range(flags.num_inference_threads)), context=context)


def to_torch(array, device):
    """A numpy array (owned by the C++ side, or a view of one) as a tensor on device.

    On the CPU this is torch.from_numpy: no copy. Towards a GPU the data goes
    through pinned memory so the copy can run asynchronously.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def inference(index, inference_batcher, models, schema, device, torch_threads=1):
    """Inference thread: answers batches of actor requests until the batcher closes.

    A batch holds one step of B actors: env_outputs arrays are [T=1, B, ...]
    and the agent state arrays [layers, B, hidden]. obs[t] -> action[t]. Every
    output of the model goes back: each is a field of the rollout.
    """
    system.set_intra_op_threads(torch_threads)
    for batch in inference_batcher:
        env_outputs, agent_state = batch.get_inputs()
        check_env_outputs(schema, env_outputs)
        inputs = {k: to_torch(v, device) for k, v in env_outputs.items()}
        state = tuple(to_torch(s, device) for s in agent_state)
        # Before the forward pass: the learner may write newer weights meanwhile.
        weights_step = training.weights_step(models)
        outputs, state = models.forward(index, inputs, state)
        # The only device-to-host copy (and sync point) of an inference step.
        agent_outputs = {k: v.cpu().numpy() for k, v in outputs.items()}
        agent_outputs[rollout.POLICY_STEP.name] = np.full(
            env_outputs["reward"].shape, weights_step, np.int64)
        batch.set_outputs((agent_outputs, tuple(s.cpu().numpy() for s in state)))


def check_env_outputs(schema, env_outputs):
    """What the env servers send enters here: each field's dtype and shape must be the
    run's, or the model would fail on it (or, worse, not: done as uint8 makes ~done 254)."""
    try:
        schema.check(env_outputs, 2, "an env server sent a step that does not fit",
                     source="env")
    except ValueError as e:
        raise training.UserError(
            f"{e}. Do the env servers run the same --env as the learner?") from None
    # Values the model cannot take. (The actor pool refuses NaN and inf in what the servers
    # send, rewards included, naming the server: libpolybeast.BadStep.)
    last_action = env_outputs["last_action"]
    for name in rollout.observation_names(env_outputs):  # frame, or a Dict's entries
        frame = env_outputs[name]
        if frame.dtype.kind == "f" and not np.isfinite(frame).all():
            raise training.UserError(f"an env server sent an observation ({name!r}) with NaN or "
                                     "inf in it; the environment (or a wrapper) produced it.")
    if schema.continuous:
        # Our own actions coming back, but from another process: NaN would reach the model.
        if not np.isfinite(last_action).all():
            raise training.UserError("an env server sent a last_action with NaN or inf in it.")
        return
    num_actions = schema.num_actions
    if last_action.size and (last_action.min() < 0 or last_action.max() >= num_actions):
        raise training.UserError(
            f"an env server sent a last_action outside [0, {num_actions}) "
            f"(min {last_action.min()}, max {last_action.max()}).")


def run_actor_pool(actor_pool, addresses, flags):
    try:
        actor_pool.run()
    except libpolybeast.BadStep as e:  # what a server sent, not where: no address to check
        raise training.UserError(str(e)) from None
    except RuntimeError as e:  # the first actor's error; it also closed the queues
        raise training.UserError(
            f"{e}\nThe actors stream from {', '.join(sorted(set(addresses)))}; start env "
            "servers there (python -m polybeast_env) or check --server_addresses / "
            f"--pipes_basename.{_tls_hint(flags, addresses)}") from None


def _tls_hint(flags, addresses):
    """What to check when servers over TCP did not answer: a TLS handshake that failed looks
    like a server that is not there (gRPC logs some handshake errors above, not all)."""
    if all(beast_flags.socket_path(a) for a in addresses):
        return ""
    if flags.tls_ca is None:
        return " Servers started with --tls_cert need --tls_ca here."
    return (" With --tls_ca: the servers must serve TLS (--tls_cert) with a certificate signed "
            "by it and made out to the host of each address (or --tls_server_name); servers "
            "started with --tls_client_ca also need --tls_cert and --tls_key here.")


# ----------------------------------------------------------------------------
# Where the acting runs: threads of this process, or a process of its own.

def create_actor_pool(flags, schema, models, addresses):
    """The learner queue, the inference batcher and the actor pool that feeds them."""
    learner_queue = libpolybeast.BatchingQueue(
        batch_dim=1, minimum_batch_size=flags.batch_size, maximum_batch_size=flags.batch_size,
        maximum_queue_size=learner_queue_size(flags))
    # Minimum 1: a batch is whatever requests came in during the previous
    # forward pass, so no actor waits for others to catch up.
    inference_batcher = libpolybeast.DynamicBatcher(
        batch_dim=1, minimum_batch_size=1, maximum_batch_size=inference_batch_size(flags))
    # The agent state of one actor has batch dim 1: [layers, 1, hidden].
    initial_agent_state = tuple(s.numpy() for s in models.replicas[0].initial_state(1))
    actor_pool = libpolybeast.ActorPool(
        unroll_length=flags.unroll_length, learner_queue=learner_queue,
        inference_batcher=inference_batcher, env_server_addresses=addresses,
        initial_agent_state=initial_agent_state, connect_timeout_s=flags.connect_timeout_s,
        stream_timeout_s=flags.stream_timeout_s, env_keys=list(schema.names("env")),
        envs_per_stream=flags.envs_per_stream,
        # int64 0, or float32 zeros [A] for a Box action space (single-environment streams).
        initial_last_action=schema.zeros((), source="env")["last_action"],
        tls=tls.learner_config(flags))
    return learner_queue, inference_batcher, actor_pool


def start_acting(errors, flags, schema, models, addresses, device):
    """Starts the actor pool's thread and the inference threads; returns (learner_queue,
    the queues to close at the end, the started threads, the actor pool). errors: the
    training.ThreadErrors that keeps their exceptions."""
    learner_queue, inference_batcher, actor_pool = create_actor_pool(flags, schema, models,
                                                                     addresses)
    threads = [errors.thread("actor-pool", run_actor_pool, actor_pool, addresses, flags)]
    threads += [errors.thread(f"inference-{i}", inference, i, inference_batcher, models,
                              schema, device, flags.inference_torch_threads,
                              on_error=inference_batcher.close)
                for i in range(flags.num_inference_threads)]
    for thread in threads:
        thread.start()
    return learner_queue, (learner_queue, inference_batcher, actor_pool), threads, actor_pool


def close_and_join(queues, threads):
    """Closing the queues wakes every thread: actors blocked in compute() or enqueue(), the
    inference threads and whoever takes from the learner queue."""
    for queue in queues:
        queue.close()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
        if thread.is_alive():
            print(f"warning: thread {thread.name} did not stop within {JOIN_TIMEOUT_S} s.",
                  file=sys.stderr)


class ActingProcess:
    """The actor pool and inference in a process of their own: forked from a
    CPU learner, spawned beside a CUDA one, where it infers on the GPU (acting_context).

    In the learner's process, inference would wait on the learner thread's locks, the GIL
    and (on Atari) the one malloc arena the learner keeps (system.reuse_freed_memory).
    Here it shares neither.
    The acting model's replicas are in shared memory, written by the learner under
    cross-process locks (InferenceModels). Each batch of rollouts reaches the learner in
    one of num_learner_threads shared-memory slots: the acting process fills a free slot
    from its learner queue and sends its index; the learner sends it back after its step.
    So no more batches are in flight than with threads: the one being learned on and
    the learner queue's.
    """

    def __init__(self, run, models, addresses, env_errors_before=0):
        flags = run.flags
        context = models.context
        self.slots = [create_slot(flags, run.schema, models)
                      for _ in range(flags.num_learner_threads)]
        self.full_reader, full_writer = context.Pipe(duplex=False)
        free_reader, self.free_writer = context.Pipe(duplex=False)
        self.error_reader, error_writer = context.Pipe(duplex=False)
        self.error_count = context.RawValue("q", 0)  # one writer
        # A flag without a lock (one writer each way): the process may die holding a
        # multiprocessing.Event's lock, and then setting it would wait for ever.
        self.stopping = context.RawValue("b", 0)
        # The learner threads share this end of the pipes.
        self.read_lock, self.write_lock = threading.Lock(), threading.Lock()
        # Kept open here too, so that a dead process leaves no end-of-file to read, only
        # silence (its messages are too short to be cut off half-way).
        self.child_ends = (free_reader, full_writer, error_writer)
        for index in range(len(self.slots)):
            self.free_writer.send(index)
        self.threads = []  # check() watches the process
        self.models, self.env_errors_before = models, env_errors_before
        self.started = time.monotonic()
        self.process = context.Process(
            target=run_acting_process, name="acting", daemon=True,
            args=(flags, run.schema, models, addresses, self.slots, free_reader, full_writer,
                  error_writer, self.error_count, self.stopping, os.getpid(), run.device))
        self.process.start()

    def env_errors(self):
        return self.env_errors_before + self.error_count.value

    def batches(self, device):
        """(batch, initial_agent_state) for a learner thread, from the slots. A CPU learner
        learns on the slot itself, which goes back once it asks for the next batch; a CUDA
        learner gets a copy on its device, and the slot goes back at once."""
        while True:
            index = self._next_full()
            if index is None:
                return
            batch, state = self.slots[index]
            if device.type != "cpu":
                # Not non_blocking: the slot must have been read before it goes back.
                batch = {k: v.to(device) for k, v in batch.items()}
                state = tuple(s.to(device) for s in state)
                self._free(index)
                yield batch, state
                continue
            yield batch, state
            self._free(index)

    def _free(self, index):
        with self.write_lock:
            self.free_writer.send(index)

    def _next_full(self):
        """The index of a filled slot; None once the process stops."""
        while not self.stopping.value:
            with self.read_lock:
                if self.full_reader.poll(0.1):
                    return self.full_reader.recv()
        return None

    def check(self):
        """Raises what went wrong in the acting process (its message), or that it died."""
        if self.error_reader.poll():
            user_error, message = self.error_reader.recv()
            raise (training.UserError if user_error else RuntimeError)(message)
        if self.process.exitcode is not None:
            raise ActingDied(self.process.exitcode)

    def close(self):
        """Asks the process to stop; kills it if it has not within JOIN_TIMEOUT_S. Then no
        one holds the acting model's locks but, perhaps, the dead: abandon them."""
        self.stopping.value = 1
        self.process.join(JOIN_TIMEOUT_S)
        if self.process.is_alive():
            print(f"warning: the acting process did not stop within {JOIN_TIMEOUT_S} s; "
                  "killing it.", file=sys.stderr)
            self.process.kill()
            self.process.join(JOIN_TIMEOUT_S)
        self.models.abandon()


class ActingDied(RuntimeError):
    """The acting process ended before it was told to: killed (the OOM killer), or it
    exited, which it does only when told to or after sending its error."""

    def __init__(self, exitcode):
        self.exitcode = exitcode
        super().__init__(f"The acting process (actor threads and inference) "
                         f"{restarts.how_it_ended(exitcode)} while the run went on.")


def create_slot(flags, schema, models):
    """Shared memory for one learner batch: every rollout field [T+1, B, ...] and the
    agent state before step 0 of each rollout [layers, B, hidden]. On the CPU, whatever the
    learner's device: the acting process writes it from the actor pool's arrays."""
    state = tuple(s.cpu().share_memory_()
                  for s in models.replicas[0].initial_state(flags.batch_size))
    return schema.shared_zeros((flags.unroll_length + 1, flags.batch_size)), state


def run_acting_process(flags, schema, models, addresses, slots, free_reader, full_writer,
                       error_writer, error_count, stopping, parent, device):
    """The acting process's main thread: starts the actor pool, inference (on device, the
    learner's) and the thread that fills the slots, then watches them until the learner asks
    it to stop, the learner is gone, or one of them fails (its message goes to the learner)."""
    system.leave_stop_signals_to_the_learner()
    system.name_os_thread("acting")
    torch.set_num_threads(1)
    errors = training.ThreadErrors()
    learner_queue, queues, threads, actor_pool = start_acting(
        errors, flags, schema, models, addresses, device)
    threads.append(errors.thread("fill-slots", fill_slots, learner_queue, slots, free_reader,
                                 full_writer, stopping))
    threads[-1].start()
    try:
        while not stopping.value and os.getppid() == parent:
            time.sleep(0.1)
            error_count.value = actor_pool.env_errors()
            failure = _failure(errors, threads, stopping)
            if failure is not None:
                error_writer.send(failure)
                return
    finally:
        stopping.value = 1  # fill-slots stops waiting for a free slot
        close_and_join(queues, threads)
        # A spawned process's replicas are the learner's GPU memory (CUDA IPC): let go of
        # them before exiting (a process ends without freeing), or the learner warns at its
        # exit that they were never released.
        models.replicas.clear()
        gc.collect()


def _failure(errors, threads, stopping):
    """(is a UserError, message) for the first thread that failed or ended; else None."""
    ended = [t.name for t in threads if not t.is_alive()]
    if ended and stopping.value:
        # fill-slots ends once the learner asks the process to stop, which may happen during
        # the sleep before this check: the actor pool is still running, and waiting for it
        # here would hold the stop up until JOIN_TIMEOUT_S and the learner's kill.
        return None
    if ended:
        # An actor pool that fails closes the queues, which ends the other threads before
        # its own (it joins its actors first): wait for it, threads[0], to say why.
        threads[0].join(JOIN_TIMEOUT_S)
    try:
        errors.raise_first()
    except Exception as e:
        return isinstance(e, training.UserError), str(e)
    if ended:
        return False, f"thread {', '.join(ended)} of the acting process ended unexpectedly."
    return None


def fill_slots(learner_queue, slots, free_reader, full_writer, stopping):
    """Copies each batch of the learner queue into a free slot and sends its index. A free
    slot first: the learner queue keeps the next batch meanwhile, so that batches are not
    taken from it earlier than the learner can use them."""
    system.set_intra_op_threads(1)
    batches = iter(learner_queue)
    while True:
        index = _next_free(free_reader, stopping)
        pair = None if index is None else next(batches, None)
        if pair is None:
            return
        batch, state = slots[index]
        rollouts, initial_agent_state = pair
        for name, array in rollouts.items():
            batch[name].copy_(torch.from_numpy(array))
        for tensor, array in zip(state, initial_agent_state):
            tensor.copy_(torch.from_numpy(array))
        full_writer.send(index)


def _next_free(free_reader, stopping):
    while not stopping.value:
        if free_reader.poll(0.1):
            return free_reader.recv()
    return None


# ----------------------------------------------------------------------------
# What PolyBeast plugs into the run skeleton of beast/training.py.

def train_loop(run, models, servers):
    """Runs actors, inference and learner threads until total_steps or a stop."""
    flags = run.flags
    if servers is not None:
        addresses = servers.addresses
        servers.wait_until_listening(flags.connect_timeout_s, run.stop)
        if run.stop.is_set():
            print("Stopping on request before training started.", file=sys.stderr)
            return
    else:
        addresses = actor_addresses(flags, server_list(flags))
        remote = sorted({a for a in addresses if not beast_flags.is_loopback(a)})
        if remote and flags.tls_ca is None:
            print(f"warning: the env servers at {', '.join(remote)} are reached over the "
                  "network; the traffic is neither authenticated nor encrypted (see --tls_ca).",
                  file=sys.stderr)
    policy, env_errors = restarts.RestartPolicy(), 0
    while True:
        acting = ActingProcess(run, models, addresses, env_errors)
        died = None
        try:
            learn_while_acting(run, acting, servers)
            return
        except ActingDied as e:
            died = e
            why_not = policy.why_not(time.monotonic() - acting.started)
            if why_not is not None:
                raise training.UserError(f"{died} It is not started again: {why_not}.") from None
            print(f"\nwarning: {died} Starting it again (restart {policy.restarts}); the "
                  "rollouts in flight are dropped, the weights kept.", file=sys.stderr)
        finally:
            env_errors = acting.env_errors()
        # Its replacement acts with the learner's latest weights, under new locks.
        models.renew_locks()
        run.learner.publish()


def learn_while_acting(run, acting, servers):
    """Learner threads on acting's batches, supervised until total_steps, a stop or an
    error (ActingDied: the acting process is gone); they are joined before it returns."""
    def check():
        acting.check()
        if servers is not None:
            servers.check()

    threads = []
    try:
        threads += [run.errors.thread(f"learner-{i}", run.learner_thread,
                                      acting.batches(run.device))
                    for i in range(run.flags.num_learner_threads)]
        for thread in threads:
            thread.start()
        run.supervise(threads + acting.threads, check, env_errors=acting.env_errors)
    finally:
        acting.close()
        close_and_join([], threads + acting.threads)


VARIANT = training.Variant(make_parser=make_parser, check_flags=check_flags,
                           acting_model=acting_model, train_loop=train_loop,
                           environments=environments, per_start_flags=PER_START_FLAGS,
                           distributed=True)


main = functools.partial(training.main, VARIANT)  # main(argv=None) -> exit code


if __name__ == "__main__":
    sys.exit(main())
