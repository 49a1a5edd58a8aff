"""--deterministic: MonoBeast's actors and learner on a fixed schedule, so that a run
with actor processes is reproducible (monobeast.train picks it).

Without it, timing decides which rollouts form a batch and which weights an actor acts
with. Here the Lockstep schedule fixes both; everything else (the Sampler that steps the
environments, the run's learner, logs and checkpoints) is the same as in a normal run.
"""

import contextlib
import copy
import itertools
import math
import os
import sys

import torch
from torch import multiprocessing as mp

from beast import restarts
from beast import rollout
from beast import system
from beast import training


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
                update u learns on rollouts acted with the weights of the update before
                its own, as Cleanba does; with R = 4B the lag is 4 to 7 updates, the
                same for every run.
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
        # An actor's UserError (a NaN reward, say), for the learner to end the run with.
        self.problems = ctx.SimpleQueue()

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


def layout_problems(flags):
    """What --deterministic needs of a layout: one learner thread (with several, timing would
    order the updates) and, with actor processes, enough buffers for its schedule."""
    problems = []
    if flags.num_learner_threads != 1:
        if "num_learner_threads" in getattr(flags, "typed", ()):
            problems.append("--deterministic learns in one thread: drop --num_learner_threads "
                            f"(got {flags.num_learner_threads}) or set it to 1.")
        else:
            problems.append("--deterministic learns in one thread, and this run's saved "
                            f"--num_learner_threads is {flags.num_learner_threads}: type "
                            "--num_learner_threads 1.")
    if flags.num_actors > 0 and flags.num_buffers < lockstep_num_buffers(flags):
        problems.append(f"--deterministic needs --num_buffers of at least "
                        f"{lockstep_num_buffers(flags)} with these --num_actors, "
                        "--envs_per_actor and --batch_size (2 rounds of rollouts and a batch); "
                        "raise it or leave it to its default.")
    return problems


def act_in_lockstep(actor_index, flags, lockstep, shared_model, shared_step, schema, buffers,
                    state_buffers, sampler_class):
    """Actor process of a --deterministic run: round after round, waits for the round's
    version of the weights, copies it (and shared_step, the learner step it is of) and fills
    the round's buffers with a sampler_class (monobeast.Sampler)."""
    system.leave_stop_signals_to_the_learner()
    system.name_os_thread(f"actor-{actor_index}")
    torch.set_num_threads(1)
    torch.manual_seed(flags.seed * 7919 + actor_index)
    # Its own copy (version 0 now): the learner writes the next version while this one acts.
    model, weights_step = copy.deepcopy(shared_model), shared_step.clone()
    learner_pid = os.getppid()

    def orphaned():  # the learner's process is gone (killed before it could close)
        return os.getppid() != learner_pid

    sampler = None
    try:
        # Restarts are counted per actor (error_count None): their seeds follow the schedule.
        sampler = sampler_class(flags, model, schema, buffers, state_buffers,
                                flags.envs_per_actor, seed=flags.seed * 100 + actor_index,
                                name=f"actor {actor_index}", weights_step=weights_step)
        for k in itertools.count():
            version = lockstep.weights_for_round(k)
            if not lockstep.wait(actor_index, lambda: lockstep.version.value >= version,
                                 give_up=orphaned):
                return
            model.load_state_dict(shared_model.state_dict())
            weights_step.copy_(shared_step)
            if not lockstep.advance(lockstep.taken, actor_index, k + 1, orphaned):
                return
            indices = lockstep.round_buffers(actor_index, k)
            sampler.unroll(indices)
            for m in indices:
                lockstep.restarts[m] = sampler.envs.restarts
            if not lockstep.advance(lockstep.filled, actor_index, k + 1, orphaned):
                return
    except training.UserError as e:  # the learner gives the message (learn_in_lockstep)
        lockstep.problems.put(str(e))
    finally:
        if sampler is not None:
            sampler.close()


def train(run, model, buffers, state_buffers, sampler_class):
    """--deterministic with actor processes: actors on the Lockstep schedule, one learner
    thread (learn_in_lockstep); this thread only waits for it and for a stop request.
    sampler_class: what steps an actor's environments (monobeast.Sampler).

    model: the shared-memory acting model, which run.learner writes after each update
    (Learner.update): the schedule's next version, published by advancing the counter.
    """
    flags = run.flags
    ctx = mp.get_context("fork")
    lockstep = Lockstep(ctx, flags)
    actors = [ctx.Process(target=act_in_lockstep, name=f"actor-{i}", daemon=True,
                          args=(i, flags, lockstep, model, run.learner.weights_step,
                                run.schema, buffers, state_buffers, sampler_class))
              for i in range(flags.num_actors)]
    for process in actors:
        process.start()
    # Not in this thread: the main thread waits for signals, and torch's intra-op threads
    # ran the learner's small ops slower from the main thread than from another one.
    learner = run.thread("learner", learn_in_lockstep, run, lockstep, actors, buffers,
                         state_buffers)
    learner.start()
    try:
        while learner.is_alive():
            learner.join(timeout=0.2)  # wakes for signals, which set run.stop
        run.errors.raise_first()
    finally:
        lockstep.close()
        learner.join(timeout=60)
        restarts.join_actors(actors)


def learn_in_lockstep(run, lockstep, actors, buffers, state_buffers):
    """The learner thread of a --deterministic run: the schedule's batches in order, and
    between steps what serial mode does between steps (status, checkpoints, evaluation),
    so that the rows of logs.csv come in a fixed order too."""
    flags = run.flags
    env_restarts = [0] * flags.num_actors  # each actor's, as of the last rollout learned

    def give_up():
        if not lockstep.problems.empty():
            raise training.UserError(lockstep.problems.get())
        try:
            restarts.check_actors(actors)
        except restarts.ActorDied as died:
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
            env_restarts[lockstep.actor_of(r)] = lockstep.restarts[m]
        batch, initial_agent_state = rollout.to_device(
            *rollout.select_batch(buffers, state_buffers, indices), run.device)
        run.record(*run.learner.update(batch, initial_agent_state), batch)
        update += 1
        if not lockstep.advance(lockstep.version, None, update, give_up):
            break
        run.housekeeping(env_errors=sum(env_restarts))
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
