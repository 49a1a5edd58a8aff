"""PolyBeast's acting model: one replica per inference thread, each behind a lock that works
across the acting process and the learner."""

import threading

from beast import models

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
            return models.act(self.replicas[index], inputs, core_state)
