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
import queue
import signal
import sys

import numpy as np
import torch
from torch import multiprocessing as mp

from beast import flags as beast_flags
from beast import training
from beast import vector_envs

# Environments each actor steps together, by kind of environment (beast/flags.py ENV_DEFAULTS).
ENVS_PER_ACTOR = {"atari": 4, "image": 32, "vector": 32}


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
                             "(default: max(2 * num_actors * envs_per_actor, 2 * batch_size)).")
    return parser


# ----------------------------------------------------------------------------
# Buffers.

def create_buffers(flags, schema):
    """Shared-memory tensors [T+1, num_buffers, ...], one per field of the rollout
    schema: index_select on dim 1 gives a time-major batch in one copy."""
    leading = (flags.unroll_length + 1, flags.num_buffers)
    return {name: torch.zeros(leading + f.shape, dtype=f.torch_dtype).share_memory_()
            for name, f in schema.fields.items()}


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
                 error_count=None, name="actor"):
        self.flags = flags
        self.model = model
        self.num_envs = num_envs
        self.buffers = {k: v.numpy() for k, v in buffers.items()}
        self.state_buffers = state_buffers
        self.error_count = error_count
        self.agent_keys = schema.names("agent")
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
        with torch.no_grad():
            output, self.agent_state = self.model(inputs, self.agent_state)
        return {k: output[k][0].numpy() for k in self.agent_keys}

    def _write(self, t, indices):
        for key, value in self.current.items():
            self.buffers[key][t, indices] = value
        for key, value in self.agent_output.items():
            self.buffers[key][t, indices] = value

    def _step_envs(self):
        self._store(self.envs.step(self.agent_output["action"]))

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
        error_count):
    """Actor process: takes free buffer indices, fills them, hands them on."""
    # Ctrl-C goes to the whole process group; the learner decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    torch.manual_seed(flags.seed * 7919 + actor_index)
    sampler = Sampler(flags, model, schema, buffers, state_buffers, flags.envs_per_actor,
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


# ----------------------------------------------------------------------------
# What MonoBeast plugs into the run skeleton of beast/training.py.

def check_flags(flags, info):
    """MonoBeast's own env-dependent flags; returns the problems found."""
    if flags.envs_per_actor is None:
        flags.envs_per_actor = ENVS_PER_ACTOR[info["kind"]]
    if flags.num_buffers is None:
        flags.num_buffers = max(2 * max(flags.num_actors, 1) * flags.envs_per_actor,
                                2 * flags.batch_size)
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
    return problems


def acting_model(flags, info, model):
    """Actors read the weights from a CPU copy in shared memory."""
    copy = training.build_model(flags, info)
    copy.share_memory()
    return copy


def train_loop(run, model, environments):
    flags = run.flags
    buffers = create_buffers(flags, run.schema)
    state_buffers = create_state_buffers(model, flags.num_buffers)
    if flags.num_actors == 0:
        train_serial(run, model, buffers, state_buffers)
    else:
        train_parallel(run, model, buffers, state_buffers)


def train_parallel(run, model, buffers, state_buffers):
    """Actor processes fill buffers; learner threads in this process learn on them."""
    flags = run.flags
    ctx = mp.get_context("fork")
    free_queue, full_queue = ctx.SimpleQueue(), ctx.SimpleQueue()
    error_count = ctx.Value("i", 0)
    actors = [ctx.Process(target=act, name=f"actor-{i}", daemon=True,
                          args=(i, flags, free_queue, full_queue, model, run.schema, buffers,
                                state_buffers, error_count))
              for i in range(flags.num_actors)]
    for process in actors:
        process.start()
    for m in range(flags.num_buffers):
        free_queue.put(m)

    def batches():
        return iter(lambda: get_batch(flags, full_queue, free_queue, buffers, state_buffers,
                                      run.device), None)

    def check_actors():
        for i, process in enumerate(actors):
            if process.exitcode not in (None, 0):
                raise RuntimeError(f"Actor process {i} died with exit code "
                                   f"{process.exitcode}; its traceback is above.")

    threads = [run.errors.thread(f"learner-{i}", run.learner_thread, batches())
               for i in range(flags.num_learner_threads)]
    for thread in threads:
        thread.start()
    try:
        run.supervise(threads, check_actors, env_errors=lambda: error_count.value)
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
