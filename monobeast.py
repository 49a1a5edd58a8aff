"""MonoBeast: single-machine IMPALA in pure Python and PyTorch.

Data path:
  actor processes (each steps --envs_per_actor environments and runs one
  batched forward pass for all of them)
    -> shared-memory rollout buffers [T+1, num_buffers, ...]
    -> full_queue (buffer indices) -> learner threads (V-trace loss, RMSprop)
    -> free_queue (indices back to the actors); new weights -> actor model.

train() below is the whole run, top to bottom. Run `python -m monobeast --help` for the
flags. `--num_actors 0` steps the environments in the learner's own thread (serial mode,
for debuggers). `--deterministic` replaces the two queues by a fixed schedule
(beast/lockstep.py), so that runs with actor processes are reproducible.

The services the run calls (flags checked, run directory, resume, logs, checkpoints,
evaluation, --mode test) are beast/training.py, which PolyBeast shares; the loss and the
update are beast/loss.py and beast/learner.py.
"""

import argparse
import os
import queue
import sys
import time

import numpy as np
import torch

from beast import actor_processes
from beast import flags as beast_flags
from beast import lockstep
from beast import machine
from beast import models
from beast import restarts
from beast import rollout
from beast import system
from beast import training
from beast import unused_flags
from beast import vector_envs

# Actor processes on a laptop: one per core, so that a run learns the same way everywhere.
DEFAULT_NUM_ACTORS = 2
# Environments each actor steps together, by kind of environment (beast/flags.py ENV_DEFAULTS).
ENVS_PER_ACTOR = {"atari": 8, "sticky_atari": 8, "image": 32, "vector": 32, "continuous": 16,
                  "nethack": 16}


def make_parser():
    parser = argparse.ArgumentParser(
        description="MonoBeast: single-machine IMPALA.",
        formatter_class=beast_flags.HelpFormatter)
    groups = beast_flags.add_common_flags(parser)
    # Actors and buffers.
    groups.torchbeast.add_argument(
        "--num_actors", type=beast_flags.Number(int, low=0), default=None,
        help="Actor processes; 0 steps the environments in the learner's thread (serial mode, "
             f"for debugging) (default: {DEFAULT_NUM_ACTORS}, one per core of a laptop; on a "
             f"GPU machine, a CUDA learner with at least {machine.GPU_MACHINE_MIN_CORES} "
             "cores, one per core but the two its learner threads take).")
    groups.torchbeast.add_argument(
        "--num_buffers", type=beast_flags.Number(int, low=1), default=None,
        help="Shared-memory rollout buffers (default: max(2 * num_actors * envs_per_actor, "
             "2 * batch_size); with --deterministic the fewest its schedule needs).")
    groups.environment.add_argument(
        "--envs_per_actor", type=beast_flags.Number(int, low=1), default=None,
        help="Environments each actor steps together, with one forward pass for all "
             f"(default: {beast_flags.describe_defaults(ENVS_PER_ACTOR)}).")
    groups.run.add_argument(
        "--deterministic", action="store_true",
        help="Reproducible runs with actor processes: every batch comes from a fixed set of "
             "rollouts, acted with the weights of a fixed earlier update; one learner thread "
             "(costs some speed).")
    groups.operations.add_argument(
        "--actor_timeout_s", type=beast_flags.Number(float, low=0), default=30.0,
        help="Kill and start the actors again when one has spent this long on its start or one "
             "step (environments and forward pass: a hung environment, a stuck process); its "
             "Python stack is printed first. 0: never. Not with --deterministic.")
    return parser


def default_num_actors(gpu_machine):
    """DEFAULT_NUM_ACTORS; on a GPU machine one actor per core but the two that its learner
    threads take."""
    if not gpu_machine:
        return DEFAULT_NUM_ACTORS
    return max(DEFAULT_NUM_ACTORS, machine.cores() - 2)


def resolve_flags(flags, env):
    """Fills MonoBeast's own flags that depend on the environment (env: training.EnvSpec)
    where they were left to their defaults, then checks them; returns the problems found."""
    if flags.num_actors is None:
        flags.num_actors = default_num_actors(training.on_gpu_machine(flags))
    if flags.envs_per_actor is None:
        flags.envs_per_actor = ENVS_PER_ACTOR[env.kind]
    if flags.num_torch_threads is None and flags.num_actors > 0 and flags.mode == "train":
        flags.num_torch_threads = beast_flags.default_num_torch_threads(flags.num_actors)
    if flags.num_buffers is None:
        flags.num_buffers = max(2 * max(flags.num_actors, 1) * flags.envs_per_actor,
                                2 * flags.batch_size)
        if flags.deterministic and flags.num_actors > 0:
            flags.num_buffers = lockstep.lockstep_num_buffers(flags)
    problems = beast_flags.range_problems(flags, make_parser())
    problems += unused_flags.monobeast_layout(flags)
    if flags.deterministic:
        problems += lockstep.layout_problems(flags)
    if flags.num_buffers < flags.batch_size:
        problems.append(f"--num_buffers ({flags.num_buffers}) must be at least --batch_size "
                        f"({flags.batch_size}), or no batch can ever be formed.")
    if flags.num_actors > 0 and flags.num_buffers < flags.num_actors * flags.envs_per_actor:
        problems.append(f"--num_buffers ({flags.num_buffers}) must be at least --num_actors x "
                        f"--envs_per_actor ({flags.num_actors * flags.envs_per_actor}).")
    return problems


# ----------------------------------------------------------------------------
# The run.

def train(flags):
    """Trains until --total_steps or a stop request; the last checkpoint is written whatever
    ended it."""
    with training.Setup(flags, resolve_flags) as setup:
        # The actors read the weights from a CPU copy in shared memory, in
        # --acting_precision; the learner writes it after every update.
        acting_model = training.build_acting_model(flags, setup.env)
        acting_model.share_memory()
        with training.Run(setup, acting_model) as run:
            buffers = create_buffers(flags, run.schema)
            state_buffers = create_state_buffers(acting_model, flags.num_buffers)
            with lockstep.deterministic_kernels(flags.deterministic):
                if flags.num_actors == 0:
                    train_serial(run, acting_model, buffers, state_buffers)
                elif flags.deterministic:
                    lockstep.train(run, acting_model, buffers, state_buffers, Sampler)
                else:
                    train_with_actors(run, acting_model, buffers, state_buffers)


def learn(run, batches):
    """A learner thread: batch -> update -> record, until total_steps or the end of
    `batches` (the actors stopped)."""
    system.set_intra_op_threads(run.flags.num_torch_threads)
    for batch, initial_agent_state in run.stats.timed(batches):
        step, stats = run.learner.update(batch, initial_agent_state)
        run.record(step, stats, batch)  # logs.csv, evaluation snapshots
        if run.done():
            return


def train_with_actors(run, acting_model, buffers, state_buffers):
    """Actor processes fill the shared buffers, learner threads learn on them (learn), and
    this thread watches both and keeps the run's books (status, checkpoints, evaluation).

    When an actor process is killed (beast/restarts.py says when that is a fault to ride
    out), the queues may be left locked by it (it dies waiting on one, holding its lock),
    so the whole acting side is started again: the other actors and the learner threads are
    stopped, the rollouts in flight dropped, and fresh actors act with the learned weights
    on new queues and freshly seeded environments."""
    flags = run.flags
    policy, env_errors = restarts.RestartPolicy(), 0
    while not run.done() and not run.stop.is_set():
        actors = actor_processes.ActorProcesses(
            flags, actor, (acting_model, run.learner.weights_step, run.schema, buffers,
                           state_buffers), policy.restarts, env_errors)
        batches = iter(lambda: get_batch(flags, actors.full_queue, actors.free_queue,
                                         buffers, state_buffers, run.device), None)
        learners = [run.thread(f"learner-{i}", learn, run, batches)
                    for i in range(flags.num_learner_threads)]
        for thread in learners:
            thread.start()
        died = None
        try:
            while run.running():
                actors.check()  # raises ActorDied for an actor that died or hangs
                run.check_threads(learners)
                run.housekeeping(env_errors=actors.env_errors())
        except restarts.ActorDied as e:
            died = e
            if died.exitcode > 0:  # it raised: its traceback above shows a bug, not a fault
                raise training.UserError(str(died)) from None
            restarts.start_again_or_stop(policy, died, actors.started,
                                         "The actors are not started again",
                                         "Starting the actors again")
        finally:
            env_errors = actors.stop(learners, kill=died is not None)


def train_serial(run, acting_model, buffers, state_buffers):
    """--num_actors 0: everything in this thread: step the environments, learn, repeat."""
    flags = run.flags
    sampler = Sampler(flags, acting_model, run.schema, buffers, state_buffers,
                      flags.batch_size, seed=flags.seed * 100,
                      weights_step=run.learner.weights_step)
    free_queue, full_queue = queue.SimpleQueue(), queue.SimpleQueue()
    for m in range(flags.num_buffers):
        free_queue.put(m)
    try:
        while not run.done() and not run.stop.is_set():
            indices = [free_queue.get() for _ in range(flags.batch_size)]
            sampler.unroll(indices)
            for index in indices:
                full_queue.put(index)
            batch, initial_agent_state = get_batch(flags, full_queue, free_queue, buffers,
                                                   state_buffers, run.device)
            step, stats = run.learner.update(batch, initial_agent_state)
            run.record(step, stats, batch)
            run.housekeeping(env_errors=sampler.envs.restarts)
    finally:
        sampler.close()


def get_batch(flags, full_queue, free_queue, buffers, state_buffers, device):
    """Takes batch_size filled buffers; returns (batch, initial_agent_state) or None at shutdown."""
    indices = []
    for _ in range(flags.batch_size):
        index = full_queue.get()
        if isinstance(index, str):  # an actor's message (actor): now, not after a whole batch
            raise training.UserError(index)
        indices.append(index)
    if any(i is None for i in indices):
        return None
    batch, state = rollout.select_batch(buffers, state_buffers, indices)
    for i in indices:  # The copies above are done: the buffers can be refilled.
        free_queue.put(i)
    return rollout.to_device(batch, state, device)


# ----------------------------------------------------------------------------
# Acting: the actor processes and what they run.

class Sampler:
    """Steps a group of environments in lockstep and writes their rollouts.

    Each environment owns one buffer index per unroll. One forward pass of the
    model serves the whole group, which is what makes acting on the CPU cheap.
    Every field of the rollout schema is written: the env fields from the
    vector env, the agent fields from the model's outputs.
    """

    def __init__(self, flags, model, schema, buffers, state_buffers, num_envs, seed,
                 error_count=None, name="actor", busy_since=None, weights_step=None):
        self.flags = flags
        # Since when this actor has been on its current step (time.time(); 0: it waits for
        # buffers), for the learner's watchdog (ActorProcesses.check); None: unwatched.
        self.busy_since = busy_since
        self._busy()
        self.model = model
        # The learner step of model's weights (learner.Learner.weights_step, int64 []); None:
        # a model no learner writes to, step 0.
        self.weights_step = weights_step
        self.num_envs = num_envs
        self.buffers = {k: v.numpy() for k, v in buffers.items()}
        self.state_buffers = state_buffers
        self.error_count = error_count
        self.name = name
        self.model_keys = schema.model_names()
        self.envs = vector_envs.create_vector_env(flags, num_envs, seed,
                                                  on_error=self._count_error, name=name)
        # The group's current step, [k, ...] numpy arrays; torch views share them.
        self.current = schema.zeros((num_envs,), source="env")
        self.current_torch = {k: torch.from_numpy(v) for k, v in self.current.items()}
        self._store(self.envs.initial())
        self.agent_state = model.initial_state(num_envs)
        # State before the forward pass that produced the pending agent output.
        self.state_before = self.agent_state
        self.agent_output = self._act()
        self._busy(False)

    def _count_error(self):
        """The run-wide restart count (it also seeds the replacement environment)."""
        if self.error_count is None:
            return None
        with self.error_count.get_lock():
            self.error_count.value += 1
            return self.error_count.value

    def _store(self, env_outputs):
        problem = vector_envs.nonfinite_problem(env_outputs, self.flags.env)
        if problem is not None:
            raise training.UserError(f"{self.name}: {problem}")
        for key, array in self.current.items():
            array[...] = env_outputs[key]

    def _act(self):
        inputs = {k: v.unsqueeze(0) for k, v in self.current_torch.items()}
        self.state_before = self.agent_state
        # Before the forward pass: the learner may write newer weights during it.
        weights_step = 0 if self.weights_step is None else int(self.weights_step)
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
        self._busy()
        self._store(self.envs.step(self.agent_output["action"]))

    def _busy(self, busy=True):
        """Each step starts the watchdog's clock again: the environments' step and the forward
        pass after it, so that it finds a hang in either (a stuck environment, a lock that a
        fork copied held)."""
        if self.busy_since is not None:
            self.busy_since.value = time.time() if busy else 0.0

    def unroll(self, indices):
        """Fills buffers [0..T, indices]: step 0 repeats the last step of the
        previous unroll, so the learner can bootstrap across the seam."""
        self._busy()
        indices = np.asarray(indices)
        for s, state in zip(self.state_buffers, self.state_before):
            s[torch.from_numpy(indices)] = state.transpose(0, 1)
        self._write(0, indices)
        for t in range(1, self.flags.unroll_length + 1):
            self._step_envs()                # action[t-1] -> env output x_t
            self.agent_output = self._act()  # obs[t] -> action[t]
            self._write(t, indices)
        self._busy(False)

    def close(self):
        self.envs.close()


def actor(actor_index, flags, free_queue, full_queue, error_count, busy_since, times_restarted,
          model, weights_step, schema, buffers, state_buffers):
    """An actor process (started by beast/actor_processes.py): takes free buffer indices,
    fills them, hands them on, until it takes a None.
    error_count, busy_since: the shared environment-restart count and the value the actor's
    Sampler writes for the watchdog. times_restarted: how often the actors were started
    again (train_with_actors): new seeds each time.
    weights_step: the learner step of model's weights (learner.Learner.weights_step)."""
    system.leave_stop_signals_to_the_learner()
    system.name_os_thread(f"actor-{actor_index}")
    actor_processes.print_stack_when_hung()
    torch.set_num_threads(1)
    torch.manual_seed(flags.seed * 7919 + actor_index + 1_000_003 * times_restarted)
    # A learner killed outright sends no stop, and the other actors keep the queue's pipe
    # open: without this the actor would wait on free_queue for ever.
    restarts.when_orphaned(os.getppid(), lambda: os._exit(0), name="learner-watch")
    sampler = None
    try:
        sampler = Sampler(flags, model, schema, buffers, state_buffers, flags.envs_per_actor,
                          seed=flags.seed * 100 + actor_index + 1_000_003 * times_restarted,
                          error_count=error_count, name=f"actor {actor_index}",
                          busy_since=busy_since, weights_step=weights_step)
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
    except training.UserError as e:  # the learner says it (get_batch), then stops the actors
        busy_since.value = 0.0
        full_queue.put(str(e))
        while free_queue.get() is not None:  # an end before the stop would count as a death
            pass
    finally:
        if sampler is not None:
            sampler.close()


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
# The command line.

def test(flags):
    """--mode test: plays --test_episodes with the run's checkpoint."""
    return training.test(flags, resolve_flags)


def main(argv=None):
    """Runs --mode train or test; returns the exit code (2 for a problem the user can fix)."""
    return training.run_command(train, test, training.parse_flags(make_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
