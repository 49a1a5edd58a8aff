"""MonoBeast's actor processes as the learner keeps them: their start, the two queues
between them and the learner, the watchdog that finds a dead or hung actor, and their stop.
The actors' own loop is monobeast.actor; when to start them again is beast/restarts.py."""

import faulthandler
import os
import signal
import time
from multiprocessing.reduction import ForkingPickler

from torch import multiprocessing as mp

from beast import restarts


class ActorProcesses:
    """One start of the actor processes and the two queues between them and the learner:
    free_queue (buffer indices to fill) and full_queue (filled ones)."""

    def __init__(self, flags, target, shared, times_restarted=0, env_errors=0):
        """Starts flags.num_actors processes of target(i, flags, free_queue, full_queue,
        error_count, busy_since, times_restarted, *shared) (monobeast.actor), then hands them
        every buffer index."""
        self.flags = flags
        ctx = mp.get_context("fork")
        self.free_queue, self.full_queue = ctx.SimpleQueue(), ctx.SimpleQueue()
        self.error_count = ctx.Value("i", 0)
        self.env_errors_before = env_errors
        # Lock-free: one writer each, and a killed actor must not leave a lock held.
        self.busy_since = [ctx.Value("d", 0.0, lock=False) for _ in range(flags.num_actors)]
        self.processes = [
            ctx.Process(target=target, name=f"actor-{i}", daemon=True,
                        args=(i, flags, self.free_queue, self.full_queue, self.error_count,
                              self.busy_since[i], times_restarted, *shared))
            for i in range(flags.num_actors)]
        self.started = time.monotonic()
        for since, process in zip(self.busy_since, self.processes):
            # The watchdog's clock runs from the fork: a child can hang before its Sampler
            # starts the clock (on a lock that the fork copied held, in an at-fork handler).
            since.value = time.time()
            process.start()
        for m in range(flags.num_buffers):
            self.free_queue.put(m)

    def check(self):
        """Raises ActorDied for an actor that ended, or that hangs in its start or in a step
        (its stack is printed, then it is killed)."""
        restarts.check_actors(self.processes)
        timeout = self.flags.actor_timeout_s
        for i, since in enumerate(value.value for value in self.busy_since):
            hung_s = time.time() - since
            if timeout > 0 and since > 0 and hung_s > timeout:
                print_stack_of(self.processes[i])
                self.processes[i].kill()
                raise restarts.ActorDied(i, -signal.SIGKILL, hung_s=hung_s)

    def env_errors(self):
        # Without the counter's lock: a killed actor may have held it.
        return self.env_errors_before + self.error_count.get_obj().value

    def stop(self, learner_threads, kill=False):
        """Stops the actors and the learner threads that take their batches; returns the
        environment errors so far. kill: after an actor died, the others are killed rather
        than asked, since the dead one may hold the lock of the queue they wait on."""
        flags = self.flags
        if kill:
            for process in self.processes:
                process.kill()
        else:  # the actors first, so no one waits on a queue that nobody feeds
            for _ in range(flags.num_actors * flags.envs_per_actor):
                self.free_queue.put(None)
        for _ in learner_threads:
            for _ in range(flags.batch_size):
                put_unlocked(self.full_queue, None)
        for thread in learner_threads:
            thread.join(timeout=60)
        restarts.join_actors(self.processes)
        return self.env_errors()


STACK_SIGNAL = signal.SIGUSR1
STACK_WAIT_S = 1.0


def print_stack_when_hung():
    """In an actor: its threads' Python stacks go to stderr on STACK_SIGNAL, from a C-level
    handler that needs neither the GIL nor the thread that hangs. To file descriptor 2, which
    is there even where sys.stderr is no file (a notebook, a captured test)."""
    faulthandler.register(STACK_SIGNAL, file=2, all_threads=True)


def print_stack_of(process):
    """Asks a hung actor for its stacks (print_stack_when_hung), and gives it STACK_WAIT_S to
    write them, so that the kill that follows leaves a record of where it hung."""
    try:
        os.kill(process.pid, STACK_SIGNAL)
    except ProcessLookupError:  # it ended meanwhile
        return
    time.sleep(STACK_WAIT_S)


def put_unlocked(simple_queue, item):
    """SimpleQueue.put without the queue's write lock, which an actor killed in the middle of
    a put keeps for ever (waiting on it hung a restart). Safe without it: a message this small
    goes into the pipe in one write, which POSIX makes atomic below PIPE_BUF bytes, so it
    cannot interleave with another; a killed writer leaves a whole message or none."""
    simple_queue._writer.send_bytes(ForkingPickler.dumps(item))
