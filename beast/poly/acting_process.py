"""PolyBeast's acting side in a process of its own: the actor pool, the dynamic batcher and
the inference threads (polybeast.start_acting), with the rules for its failures and the
shared-memory slots that carry its batches to the learner."""

import gc
import os
import signal
import sys
import threading
import time

import torch
from torch import multiprocessing as mp

from beast import actor_processes
from beast import restarts
from beast import system
from beast import training

JOIN_TIMEOUT_S = 30
# The acting process is forked, as MonoBeast's actors are: it starts at once and inherits
# the acting model's shared memory. (No gRPC runs in this process before it.) Beside a CUDA
# learner it is spawned: a forked child cannot use CUDA, and a spawned one receives the
# replicas' GPU memory through CUDA IPC (torch.multiprocessing), so inference stays there.
FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")
ACTING_START_METHODS = {"fork": FORK, "spawn": SPAWN}


def acting_context(flags, device):
    """The multiprocessing context that starts the acting process (--acting_start_method)."""
    if flags.acting_start_method is not None:
        return ACTING_START_METHODS[flags.acting_start_method]
    return FORK if device.type == "cpu" else SPAWN


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


class ActorPoolProcess:
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

    def __init__(self, run, acting_model, addresses, start_acting, env_errors_before=0):
        """start_acting: polybeast.start_acting, which the process runs to start the actor
        pool and inference; acting_model: the InferenceModels; addresses: one per actor thread."""
        flags = run.flags
        context = acting_model.context
        self.slots = [create_slot(flags, run.schema, acting_model)
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
        self.acting_model, self.env_errors_before = acting_model, env_errors_before
        self.timeout_s = flags.acting_timeout_s
        # When each inference thread began its batch (0: waiting for one); lock-free, one
        # writer each, as MonoBeast's actors' (a killed process must not leave a lock held).
        # The clock runs from the start: the process can hang before its threads exist.
        self.busy_since = [context.RawValue("d", time.time())
                           for _ in range(flags.num_inference_threads)]
        self.started = time.monotonic()
        self.process = context.Process(
            target=run_acting_process, name="acting", daemon=True,
            args=(start_acting, flags, run.schema, acting_model, run.learner.weights_step,
                  addresses, self.slots, free_reader, full_writer, error_writer,
                  self.error_count, self.stopping, os.getpid(), run.device, self.busy_since))
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
        """Raises what went wrong in the acting process (its message), or ActingDied when it
        died, or hangs in its start or in one inference batch (its stacks are printed, then
        it is killed)."""
        if self.error_reader.poll():
            user_error, message = self.error_reader.recv()
            raise (training.UserError if user_error else RuntimeError)(message)
        if self.process.exitcode is not None:
            raise ActingDied(self.process.exitcode)
        hung_s = self.hung_for()
        if self.timeout_s > 0 and hung_s > self.timeout_s:
            actor_processes.print_stack_of(self.process)
            self.process.kill()
            self.process.join(JOIN_TIMEOUT_S)
            raise ActingDied(-signal.SIGKILL, hung_s=hung_s)

    def hung_for(self):
        """Seconds the longest-busy inference thread has spent on its batch (or the process
        on its start); 0 when every one waits for a batch."""
        now = time.time()
        return max((now - since for since in (v.value for v in self.busy_since) if since > 0),
                   default=0.0)

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
        self.acting_model.abandon()


class ActingDied(RuntimeError):
    """The acting process ended before it was told to: killed (the OOM killer), or it
    exited, which it does only when told to or after sending its error."""

    def __init__(self, exitcode, hung_s=None):
        self.exitcode = exitcode
        if hung_s is None:
            how = f"{restarts.how_it_ended(exitcode)} while the run went on"
        else:
            how = (f"had spent {hung_s:.0f} s on its start or on one inference batch "
                   "(--acting_timeout_s); its stacks are above, and it was killed")
        super().__init__(f"The acting process (actor threads and inference) {how}.")


def create_slot(flags, schema, acting_model):
    """Shared memory for one learner batch: every rollout field [T+1, B, ...] and the
    agent state before step 0 of each rollout [layers, B, hidden]. On the CPU, whatever the
    learner's device: the acting process writes it from the actor pool's arrays."""
    state = tuple(s.cpu().share_memory_()
                  for s in acting_model.replicas[0].initial_state(flags.batch_size))
    return schema.shared_zeros((flags.unroll_length + 1, flags.batch_size)), state


def run_acting_process(start_acting, flags, schema, acting_model, weights_step, addresses, slots,
                       free_reader, full_writer, error_writer, error_count, stopping, parent,
                       device, busy_since):
    """The acting process's main thread: starts the actor pool, inference (on device, the
    learner's) and the thread that fills the slots, then watches them until the learner asks
    it to stop, the learner is gone, or one of them fails (its message goes to the learner).
    busy_since: one clock per inference thread for the learner's watchdog (check)."""
    system.leave_stop_signals_to_the_learner()
    system.name_os_thread("acting")
    actor_processes.print_stack_when_hung()
    torch.set_num_threads(1)
    errors = training.ThreadErrors()
    learner_queue, queues, threads, actor_pool = start_acting(
        errors, flags, schema, acting_model, weights_step, addresses, device, busy_since)
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
        acting_model.replicas.clear()
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
