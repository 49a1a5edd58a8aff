"""MonoBeast: single-machine IMPALA in pure Python and PyTorch.

Data path:
  actor processes (each steps --envs_per_actor environments and runs one
  batched forward pass for all of them)
    -> shared-memory rollout buffers [T+1, num_buffers, ...]
    -> full_queue (buffer indices) -> learner threads (V-trace loss, RMSprop)
    -> free_queue (indices back to the actors); new weights -> actor model.

Run `python -m monobeast --help` for the flags.  `--num_actors 0` steps the
environments in the learner's own process (serial mode, for debuggers).
`--deterministic` replaces the two queues by a fixed schedule (Lockstep), so that
runs with actor processes are reproducible.
"""

import argparse
import contextlib
import copy
import itertools
import math
import os
import queue
import signal
import sys
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from torch import multiprocessing as mp

from beast import flags as beast_flags
from beast import models
from beast import restarts
from beast.restarts import when_orphaned  # act()'s `restarts` is a count
from beast import rollout
from beast import training
from beast import vector_envs

# Environments each actor steps together, by kind of environment (beast/flags.py ENV_DEFAULTS).
ENVS_PER_ACTOR = {"atari": 4, "image": 32, "vector": 32, "continuous": 16}


def make_parser():
    parser = argparse.ArgumentParser(
        description="MonoBeast: single-machine IMPALA.",
        formatter_class=beast_flags.HelpFormatter)
    beast_flags.add_common_flags(parser)
    # Actors and buffers.
    parser.add_argument("--num_actors", type=int, default=2,
                        help="Actor processes; 0 steps the environments in the "
                             "learner's process (serial mode, for debugging).")
    parser.add_argument("--envs_per_actor", type=int, default=None,
                        help="Environments each actor steps together, with one forward pass "
                             "for all (default: "
                             f"{beast_flags.describe_defaults(ENVS_PER_ACTOR)}).")
    parser.add_argument("--num_buffers", type=int, default=None,
                        help="Shared-memory rollout buffers "
                             "(default: max(2 * num_actors * envs_per_actor, 2 * batch_size); "
                             "with --deterministic the fewest its schedule needs).")
    parser.add_argument("--actor_timeout_s", type=float, default=30.0,
                        help="Kill and start the actors again when one has been stepping its "
                             "environments for this long without finishing a step (a hung "
                             "environment). 0: never. Not with --deterministic.")
    parser.add_argument("--deterministic", action="store_true",
                        help="Reproducible runs with actor processes: every batch comes from "
                             "a fixed set of rollouts, acted with the weights of a fixed "
                             "earlier update; one learner thread (costs some speed).")
    return parser


# ----------------------------------------------------------------------------
# Buffers.

def create_buffers(flags, schema):
    """Shared-memory tensors [T+1, num_buffers, ...], one per field of the rollout
    schema: index_select on dim 1 gives a time-major batch in one copy."""
    return schema.shared_zeros((flags.unroll_length + 1, flags.num_buffers))


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
    Every field of the rollout schema is written: the env fields from the
    vector env, the agent fields from the model's outputs.
    """

    def __init__(self, flags, model, schema, buffers, state_buffers, num_envs, seed,
                 error_count=None, name="actor", stepping=None):
        self.flags = flags
        # Where this actor says since when it has been stepping (time.time(); 0: it is not),
        # for the learner's watchdog (Acting.check); None: nobody watches.
        self.stepping = stepping
        self._stepping(True)
        self.model = model
        self.num_envs = num_envs
        self.buffers = {k: v.numpy() for k, v in buffers.items()}
        self.state_buffers = state_buffers
        self.error_count = error_count
        self.model_keys = schema.model_names()
        self.envs = vector_envs.create_vector_env(flags, num_envs, seed,
                                                  on_error=self._count_error, name=name)
        # The group's current step, [k, ...] numpy arrays; torch views share them.
        self.current = schema.zeros((num_envs,), source="env")
        self.current_torch = {k: torch.from_numpy(v) for k, v in self.current.items()}
        self._store(self.envs.initial())
        self._stepping(False)
        self.agent_state = model.initial_state(num_envs)
        # State before the forward pass that produced the pending agent output.
        self.state_before = self.agent_state
        self.agent_output = self._act()

    def _count_error(self):
        """The run-wide restart count (it also seeds the replacement environment)."""
        if self.error_count is None:
            return None
        with self.error_count.get_lock():
            self.error_count.value += 1
            return self.error_count.value

    def _store(self, env_outputs):
        for key, array in self.current.items():
            array[...] = env_outputs[key]

    def _act(self):
        inputs = {k: v.unsqueeze(0) for k, v in self.current_torch.items()}
        self.state_before = self.agent_state
        # Before the forward pass: the learner may write newer weights during it.
        weights_step = training.weights_step(self.model)
        output, self.agent_state = models.act(self.model, inputs, self.agent_state)
        agent_output = {k: output[k][0].numpy() for k in self.model_keys}
        agent_output[rollout.POLICY_STEP.name] = np.full(self.num_envs, weights_step, np.int64)
        return agent_output

    def _write(self, t, indices):
        for key, value in self.current.items():
            self.buffers[key][t, indices] = value
        for key, value in self.agent_output.items():
            self.buffers[key][t, indices] = value

    def _step_envs(self):
        self._stepping(True)
        self._store(self.envs.step(self.agent_output["action"]))
        self._stepping(False)

    def _stepping(self, now):
        if self.stepping is not None:
            self.stepping.value = time.time() if now else 0.0

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
        self.envs.close()


def act(actor_index, flags, free_queue, full_queue, model, schema, buffers, state_buffers,
        error_count, restarts=0, stepping=None):
    """Actor process: takes free buffer indices, fills them, hands them on.
    restarts: how often the actors were started again (train_parallel): new seeds each time.
    stepping: the shared value the actor's Sampler writes for the watchdog."""
    training.leave_stop_signals_to_the_learner()
    training.name_os_thread(f"actor-{actor_index}")
    torch.set_num_threads(1)
    torch.manual_seed(flags.seed * 7919 + actor_index + 1_000_003 * restarts)
    sampler = Sampler(flags, model, schema, buffers, state_buffers, flags.envs_per_actor,
                      seed=flags.seed * 100 + actor_index + 1_000_003 * restarts,
                      error_count=error_count, name=f"actor {actor_index}",
                      stepping=stepping)
    # A learner killed outright sends no stop, and the other actors keep the queue's pipe
    # open: without this the actor would wait on free_queue for ever.
    when_orphaned(os.getppid(), lambda: os._exit(0), name="learner-watch")
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
    batch, state = select_batch(buffers, state_buffers, indices)
    for i in indices:  # The copies above are done: the buffers can be refilled.
        free_queue.put(i)
    return to_device(batch, state, device)


def select_batch(buffers, state_buffers, indices):
    """Copies the rollouts of buffers `indices` (B of them, in this order) out of shared
    memory: (batch dict of [T+1, B, ...] tensors, core state tuple of [L, B, H] tensors)."""
    index = torch.tensor(indices)
    batch = {k: v.index_select(1, index) for k, v in buffers.items()}
    state = tuple(s.index_select(0, index).transpose(0, 1).contiguous() for s in state_buffers)
    return batch, state


def to_device(batch, state, device):
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    state = tuple(s.to(device, non_blocking=True) for s in state)
    return batch, state


class ActorDied(RuntimeError):
    """An actor process ended before it was told to (or hung, and was killed)."""

    def __init__(self, index, exitcode, hung_s=None):
        self.exitcode = exitcode
        if hung_s is not None:
            how = (f"had been stepping its environments for {hung_s:.0f} s without finishing "
                   "a step (--actor_timeout_s), and was killed")
        elif exitcode < 0:
            how = restarts.how_it_ended(exitcode)
        else:
            how = f"died with exit code {exitcode}; its traceback is above"
        super().__init__(f"Actor process {index} {how}.")


def check_actors(actors):
    """Raises ActorDied if an actor process has died."""
    for i, process in enumerate(actors):
        if process.exitcode not in (None, 0):
            raise ActorDied(i, process.exitcode)


# ----------------------------------------------------------------------------
# --deterministic: a fixed schedule in place of the queues.

class Lockstep:
    """The schedule that makes a run with actor processes reproducible (--deterministic).

    With the queues, timing decides which rollouts form a batch (the order in which
    actors finish) and which weights an actor acts with (whatever the learner wrote
    last). Here both are fixed. With N actors of E environments each, R = N * E
    rollouts per round and batch size B:

      rollouts  one order for the whole run: round k is every actor's k-th unroll,
                actor 0's E rollouts first, so rollout r = k*R + i*E + j (actor i,
                environment j) lives in buffer r % num_buffers.
      batches   update u (counted from this start) learns on rollouts [u*B, (u+1)*B),
                in that order, in one learner thread.
      weights   round k is acted with version V(k) = floor(max(k - 1, 0) * R / B), the
                weights after every update that needs only rounds before k - 1, so the
                actors fill round k while the learner learns on round k - 1. With R = B
                (Pong's defaults) update u learns on rollouts acted with the weights of
                the update before its own, as Cleanba does; with R = 4B (CartPole's) the
                lag is 4 to 7 updates, the same for every run.
      copies    an actor copies version V(k) into its own model before round k (taken),
                and the learner writes the next version only once every actor that acts
                with the current one has taken it: no weights are torn or skipped.
      buffers   round k is written once version V(k) exists, i.e. once rollouts before
                V(k) * B have been copied out; with num_buffers >= 2R + B - gcd(R, B)
                (lockstep_num_buffers) it never overwrites a rollout not yet learned.

    Shared counters, read and written under `lock`: version (of the weights in the
    shared model), taken[i] and filled[i] (rounds that actor i has taken the weights
    for, and written), restarts[m] (the environment restarts of the actor that wrote
    buffer m, as of that rollout's end, so that env_errors follows the rollouts learned
    and not the timing). A change rings every party's doorbell, a semaphore: unlike
    multiprocessing.Condition's notify, ringing never waits for the woken process, so a
    killed actor cannot hang the learner.
    """

    def __init__(self, ctx, flags):
        self.envs_per_actor, self.batch_size = flags.envs_per_actor, flags.batch_size
        self.per_round = flags.num_actors * flags.envs_per_actor
        self.num_buffers = flags.num_buffers
        self.lock = ctx.Lock()
        # One per actor, then the learner's (index num_actors).
        self.doorbells = [ctx.Semaphore(0) for _ in range(flags.num_actors + 1)]
        self.version = ctx.RawValue("q", 0)
        self.taken = ctx.RawArray("q", flags.num_actors)
        self.filled = ctx.RawArray("q", flags.num_actors)
        self.restarts = ctx.RawArray("q", flags.num_buffers)
        self.closed = ctx.RawValue("b", 0)

    def weights_for_round(self, k):
        """V(k): the version of the weights that round k is acted with."""
        return max(k - 1, 0) * self.per_round // self.batch_size

    def rounds_up_to_version(self, v):
        """How many rounds are acted with versions <= v: the least k with V(k) > v."""
        return 1 + -(-(v + 1) * self.batch_size // self.per_round)

    def round_buffers(self, actor, k):
        first = k * self.per_round + actor * self.envs_per_actor
        return [(first + j) % self.num_buffers for j in range(self.envs_per_actor)]

    def batch_rollouts(self, update):
        return range(update * self.batch_size, (update + 1) * self.batch_size)

    def actor_of(self, rollout):
        return rollout % self.per_round // self.envs_per_actor

    def batch_ready(self, update):
        """Whether update `update` may start (call under `lock`): its rollouts are
        written, and every actor has taken the weights that the update will replace."""
        return (min(self.taken) >= self.rounds_up_to_version(update)
                and all(self.filled[self.actor_of(r)] > r // self.per_round
                        for r in self.batch_rollouts(update)))

    def wait(self, who, ready, give_up=None, poll_s=0.1):
        """Waits until ready() (called under the lock); who: an actor's index, or
        num_actors for the learner. Returns False instead once the schedule is closed or
        give_up() says so; give_up may also raise."""
        doorbell = self.doorbells[who]
        while True:
            # Rings so far are answered by the check below; without draining, rings while
            # nobody waited would pile up and turn this wait into a busy loop.
            while doorbell.acquire(block=False):
                pass
            if not self._lock(give_up, poll_s):
                return False
            try:
                if ready():
                    return True
            finally:
                self.lock.release()
            if self.closed.value or (give_up is not None and give_up()):
                return False
            # A ring after the check above is counted by the semaphore, never lost.
            doorbell.acquire(timeout=poll_s)

    def _lock(self, give_up=None, poll_s=0.1):
        """Takes the lock; False instead once the schedule is closed or give_up() says so.
        Never waits for it unboundedly: an actor killed while it held the lock (the OOM
        killer) holds it for ever, and the learner must still notice the death and stop."""
        while not self.lock.acquire(timeout=poll_s):
            if self.closed.value or (give_up is not None and give_up()):
                return False
        return True

    def advance(self, counter, index, value, give_up=None):
        """counter[index] = value (counter: taken, filled, or version with index None).
        False if it could not (see _lock)."""
        if not self._lock(give_up):
            return False
        try:
            if index is None:
                counter.value = value
            else:
                counter[index] = value
        finally:
            self.lock.release()
        self._ring()
        return True

    def _ring(self):
        for doorbell in self.doorbells:
            doorbell.release()

    def close(self):
        """Ends the schedule: every waiting actor returns. Without the lock (a dead actor may
        hold it): `closed` has this one writer, and goes from 0 to 1 once."""
        self.closed.value = 1
        self._ring()


def lockstep_num_buffers(flags):
    """The fewest buffers with which Lockstep never overwrites a rollout not yet learned."""
    per_round = flags.num_actors * flags.envs_per_actor
    return 2 * per_round + flags.batch_size - math.gcd(per_round, flags.batch_size)


def act_in_lockstep(actor_index, flags, lockstep, shared_model, schema, buffers,
                    state_buffers):
    """Actor process of a --deterministic run: round after round, waits for the round's
    version of the weights, copies it and fills the round's buffers."""
    training.leave_stop_signals_to_the_learner()
    training.name_os_thread(f"actor-{actor_index}")
    torch.set_num_threads(1)
    torch.manual_seed(flags.seed * 7919 + actor_index)
    # Its own copy (version 0 now): the learner writes the next version while this one acts.
    model = copy.deepcopy(shared_model)
    # Restarts are counted per actor (error_count None), so their seeds follow the schedule.
    sampler = Sampler(flags, model, schema, buffers, state_buffers, flags.envs_per_actor,
                      seed=flags.seed * 100 + actor_index, name=f"actor {actor_index}")
    learner_pid = os.getppid()

    def orphaned():  # the learner's process is gone (killed before it could close)
        return os.getppid() != learner_pid

    try:
        for k in itertools.count():
            version = lockstep.weights_for_round(k)
            if not lockstep.wait(actor_index, lambda: lockstep.version.value >= version,
                                 give_up=orphaned):
                return
            model.load_state_dict(shared_model.state_dict())
            model.weights_step.copy_(shared_model.weights_step)
            if not lockstep.advance(lockstep.taken, actor_index, k + 1, orphaned):
                return
            indices = lockstep.round_buffers(actor_index, k)
            sampler.unroll(indices)
            for m in indices:
                lockstep.restarts[m] = sampler.envs.restarts
            if not lockstep.advance(lockstep.filled, actor_index, k + 1, orphaned):
                return
    finally:
        sampler.close()


def train_lockstep(run, model, buffers, state_buffers):
    """--deterministic with actor processes: actors on the Lockstep schedule, one learner
    thread (learn_in_lockstep); this thread only waits for it and for a stop request.

    model: the shared-memory acting model, which run.learn writes after each update
    (Learner.update): the schedule's next version, published by advancing the counter.
    """
    flags = run.flags
    ctx = mp.get_context("fork")
    lockstep = Lockstep(ctx, flags)
    actors = [ctx.Process(target=act_in_lockstep, name=f"actor-{i}", daemon=True,
                          args=(i, flags, lockstep, model, run.schema, buffers, state_buffers))
              for i in range(flags.num_actors)]
    for process in actors:
        process.start()
    # Not in this thread: with 2 intra-op threads on busy cores, torch ran the learner's
    # small ops about 3x slower in the main thread than in another (CartPole, 2 cores).
    learner = run.errors.thread("learner", learn_in_lockstep, run, lockstep, actors,
                                buffers, state_buffers)
    learner.start()
    try:
        while learner.is_alive():
            learner.join(timeout=0.2)  # wakes for signals, which set run.stop
        run.errors.raise_first()
    finally:
        lockstep.close()
        learner.join(timeout=60)
        join_actors(actors)


def join_actors(actors, timeout_s=10.0):
    """Waits for the actor processes to exit (they stop on the None in their queue, or when
    the schedule closes); one that does not within timeout_s is killed (they ignore SIGTERM,
    and one may be stuck on a lock that a dead actor held)."""
    deadline = time.monotonic() + timeout_s
    for process in actors:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def learn_in_lockstep(run, lockstep, actors, buffers, state_buffers):
    """The learner thread of a --deterministic run: the schedule's batches in order, and
    between steps what serial mode does between steps (status, checkpoints, evaluation),
    so that the rows of logs.csv come in a fixed order too."""
    flags = run.flags
    restarts = [0] * flags.num_actors  # each actor's, as of the last rollout learned

    def give_up():
        try:
            check_actors(actors)
        except ActorDied as died:
            # Started again, the actors would act on another schedule: no restarts here.
            raise training.UserError(f"{died} With --deterministic the actors are not "
                                     "started again; the same command resumes the run from "
                                     "its checkpoint.") from None
        return run.stop.is_set()

    update = 0
    while not run.done():
        if not lockstep.wait(flags.num_actors, lambda: lockstep.batch_ready(update), give_up):
            break
        rollouts = lockstep.batch_rollouts(update)
        indices = [r % flags.num_buffers for r in rollouts]
        for r, m in zip(rollouts, indices):
            restarts[lockstep.actor_of(r)] = lockstep.restarts[m]
        run.learn(*to_device(*select_batch(buffers, state_buffers, indices), run.device))
        update += 1
        if not lockstep.advance(lockstep.version, None, update, give_up):
            break
        run.housekeeping(env_errors=sum(restarts))
    else:
        return  # done
    if run.stop.is_set():
        print(f"\nStopping on request; the run can be resumed with --xpid {flags.xpid}.",
              file=sys.stderr)


@contextlib.contextmanager
def deterministic_kernels(enabled):
    """With --deterministic, torch's deterministic kernels (on a GPU; the CPU's are already)
    for the run; the previous settings come back at the end. An op that has none warns."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    # cuBLAS reads it when it first runs, which is after this (at the first learner step).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]


# ----------------------------------------------------------------------------
# What MonoBeast plugs into the run skeleton of beast/training.py.

def check_flags(flags, info):
    """MonoBeast's own env-dependent flags; returns the problems found."""
    if flags.envs_per_actor is None:
        flags.envs_per_actor = ENVS_PER_ACTOR[info["kind"]]
    lockstep = flags.deterministic and flags.num_actors > 0 and flags.envs_per_actor >= 1
    if flags.num_buffers is None:
        flags.num_buffers = max(2 * max(flags.num_actors, 1) * flags.envs_per_actor,
                                2 * flags.batch_size)
        if lockstep:
            flags.num_buffers = lockstep_num_buffers(flags)
    problems = []
    if lockstep and flags.num_buffers < lockstep_num_buffers(flags):
        problems.append(f"--deterministic needs --num_buffers of at least "
                        f"{lockstep_num_buffers(flags)} with these --num_actors, "
                        "--envs_per_actor and --batch_size (2 rounds of rollouts and a batch); "
                        "raise it or leave it to its default.")
    if flags.num_actors < 0:
        problems.append(f"--num_actors must not be negative (got {flags.num_actors}).")
    if not flags.actor_timeout_s >= 0:
        problems.append(f"--actor_timeout_s must be 0 (never) or positive "
                        f"(got {flags.actor_timeout_s}).")
    if flags.envs_per_actor < 1:
        problems.append(f"--envs_per_actor must be at least 1 (got {flags.envs_per_actor}).")
    if flags.num_buffers < flags.batch_size:
        problems.append(f"--num_buffers ({flags.num_buffers}) must be at least --batch_size "
                        f"({flags.batch_size}), or no batch can ever be formed.")
    if flags.num_actors > 0 and flags.num_buffers < flags.num_actors * flags.envs_per_actor:
        problems.append(f"--num_buffers ({flags.num_buffers}) must be at least --num_actors x "
                        f"--envs_per_actor ({flags.num_actors * flags.envs_per_actor}).")
    return problems


def acting_model(flags, info, model):
    """Actors read the weights from a CPU copy in shared memory (in --acting_precision)."""
    copy = training.build_acting_model(flags, info)
    copy.share_memory()
    return copy


def train_loop(run, model, environments):
    flags = run.flags
    buffers = create_buffers(flags, run.schema)
    state_buffers = create_state_buffers(model, flags.num_buffers)
    with deterministic_kernels(flags.deterministic):
        if flags.num_actors == 0:
            train_serial(run, model, buffers, state_buffers)
        elif flags.deterministic:
            train_lockstep(run, model, buffers, state_buffers)
        else:
            train_parallel(run, model, buffers, state_buffers)


def train_parallel(run, model, buffers, state_buffers):
    """Actor processes fill buffers; learner threads in this process learn on them.

    When an actor process is killed (beast/restarts.py says when that is a fault to ride
    out), the queues may be left locked by it (it dies
    waiting on one, holding its lock), so the whole acting side is started again: the
    other actors and the learner threads are stopped, the rollouts in flight dropped, and
    fresh actors act with the learned weights on new queues and freshly seeded
    environments."""
    policy, env_errors = restarts.RestartPolicy(), 0
    while True:
        acting = Acting(run, model, buffers, state_buffers, policy.restarts, env_errors)
        died = None
        try:
            run.supervise(acting.threads, acting.check, env_errors=acting.env_errors)
            return
        except ActorDied as e:
            died = e
            if died.exitcode > 0:  # it raised: its traceback shows a bug, not a fault
                raise training.UserError(str(died)) from None
            why_not = policy.why_not(time.monotonic() - acting.started)
            if why_not is not None:
                raise training.UserError(f"{died} The actors are not started again: "
                                         f"{why_not}.") from None
            print(f"\nwarning: {died} Starting the actors again (restart {policy.restarts}); "
                  "the rollouts in flight are dropped, the weights kept.", file=sys.stderr)
        finally:
            env_errors = acting.stop(kill=died is not None)


class Acting:
    """One start of the actor processes, their queues and the learner threads."""

    def __init__(self, run, model, buffers, state_buffers, restarts=0, env_errors=0):
        flags = self.flags = run.flags
        ctx = mp.get_context("fork")
        self.free_queue, self.full_queue = ctx.SimpleQueue(), ctx.SimpleQueue()
        self.error_count = ctx.Value("i", 0)
        self.env_errors_before = env_errors
        # Lock-free: one writer each, and a killed actor must not leave a lock held.
        self.stepping = [ctx.Value("d", 0.0, lock=False) for _ in range(flags.num_actors)]
        self.actors = [
            ctx.Process(target=act, name=f"actor-{i}", daemon=True,
                        args=(i, flags, self.free_queue, self.full_queue, model, run.schema,
                              buffers, state_buffers, self.error_count, restarts,
                              self.stepping[i]))
            for i in range(flags.num_actors)]
        self.started = time.monotonic()
        for process in self.actors:
            process.start()
        for m in range(flags.num_buffers):
            self.free_queue.put(m)
        batches = iter(lambda: get_batch(flags, self.full_queue, self.free_queue, buffers,
                                         state_buffers, run.device), None)
        self.threads = [run.errors.thread(f"learner-{i}", run.learner_thread, batches)
                        for i in range(flags.num_learner_threads)]
        for thread in self.threads:
            thread.start()

    def check(self):
        """Raises ActorDied for an actor that died, or that hangs (it is killed first)."""
        check_actors(self.actors)
        timeout = self.flags.actor_timeout_s
        for i, since in enumerate(value.value for value in self.stepping):
            if timeout > 0 and since > 0 and time.time() - since > timeout:
                self.actors[i].kill()
                raise ActorDied(i, -signal.SIGKILL, hung_s=time.time() - since)

    def env_errors(self):
        # Without the counter's lock: a killed actor may have held it.
        return self.env_errors_before + self.error_count.get_obj().value

    def stop(self, kill=False):
        """Stops the actors and the learner threads; returns the environment errors so far.
        kill: after an actor died, the others are killed rather than asked, since the dead
        one may hold the lock of the queue they wait on."""
        flags = self.flags
        if kill:
            for process in self.actors:
                process.kill()
        else:  # the actors first, so no one waits on a queue that nobody feeds
            for _ in range(flags.num_actors * flags.envs_per_actor):
                self.free_queue.put(None)
        for _ in self.threads:
            for _ in range(flags.batch_size):
                put_unlocked(self.full_queue, None)
        for thread in self.threads:
            thread.join(timeout=60)
        join_actors(self.actors)
        return self.env_errors()


def put_unlocked(simple_queue, item):
    """SimpleQueue.put without the queue's write lock, which an actor killed in the middle of
    a put keeps for ever (waiting on it hung a restart). Safe without it: a message this small
    goes into the pipe in one write, which POSIX makes atomic below PIPE_BUF bytes, so it
    cannot interleave with another; a killed writer leaves a whole message or none."""
    simple_queue._writer.send_bytes(ForkingPickler.dumps(item))


def train_serial(run, model, buffers, state_buffers):
    """Everything in this process and thread: step, learn, repeat."""
    flags = run.flags
    sampler = Sampler(flags, model, run.schema, buffers, state_buffers, flags.batch_size,
                      seed=flags.seed * 100)
    free_queue, full_queue = queue.SimpleQueue(), queue.SimpleQueue()
    for m in range(flags.num_buffers):
        free_queue.put(m)
    try:
        while not run.done() and not run.stop.is_set():
            indices = [free_queue.get() for _ in range(flags.batch_size)]
            sampler.unroll(indices)
            for index in indices:
                full_queue.put(index)
            run.learn(*get_batch(flags, full_queue, free_queue, buffers, state_buffers,
                                 run.device))
            run.housekeeping(env_errors=sampler.envs.restarts)
    finally:
        sampler.close()


VARIANT = training.Variant(make_parser=make_parser, check_flags=check_flags,
                           acting_model=acting_model, train_loop=train_loop)


def main(argv=None):
    return training.main(VARIANT, argv)


if __name__ == "__main__":
    sys.exit(main())
