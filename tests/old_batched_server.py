"""A batched env server as this project's servers were before the `truncated` (and `game_over`)
fields, written in Python with grpcio from csrc/rpcenv.proto, independent of our EnvServer:
every Step is a Step.batch of N CartPoles with frame, reward, done, episode_return,
episode_step and last_action, and nothing else (no truncated, game_over, extras or
env_errors). A time limit ends an episode as done, as TorchBeast's servers treat it.

    python -m tests.old_batched_server unix:/path/to/socket [num_envs]

serves until SIGTERM; "serving" on stdout once it listens. A fault for the learner's checks
can replace the rewards: fault="nan-reward" (nan), "nan-return" (nan episode_return).
"""

import argparse
import signal
import sys
import tempfile
import threading
from concurrent import futures

import numpy as np

from beast import vector_envs

try:
    from torchbeast_server import array_of, put_array, rpcenv_modules
except ImportError:  # run as python -m tests.old_batched_server
    from tests.torchbeast_server import array_of, put_array, rpcenv_modules

FIELDS = ("frame", "reward", "done", "episode_return", "episode_step", "last_action")


class OldBatchedServer:
    """The server (module docstring) at `address`, in this process; stop() ends it."""

    def __init__(self, rpcenv, address, num_envs=2, fault=None):
        import grpc

        self.pb2, pb2_grpc = rpcenv
        self.num_envs, self.fault = num_envs, fault
        self.streams = 0

        class Servicer(pb2_grpc.RPCEnvServerServicer):
            def StreamingEnv(servicer, requests, context):  # noqa: N805 - grpc's signature
                return self._stream(requests)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb2_grpc.add_RPCEnvServerServicer_to_server(Servicer(), self.server)
        assert self.server.add_insecure_port(address) != 0, f"could not listen on {address}"
        self.server.start()

    def step_proto(self, outputs):
        step = self.pb2.Step()
        for name in FIELDS:
            array = np.array(outputs[name])
            if name == "done":
                # What a server without truncation support sends: a time limit ends the episode.
                array = array | np.asarray(outputs["truncated"])
            elif name == "reward" and self.fault == "nan-reward":
                array[-1] = np.nan
            elif name == "episode_return" and self.fault == "nan-return":
                array[-1] = np.nan
            put_array(step.batch.map[name], array)
        return step

    def _stream(self, requests):
        flags = argparse.Namespace(env="CartPole-v1", env_backend="gymnasium")
        envs = vector_envs.create_vector_env(flags, self.num_envs, seed=self.streams)
        self.streams += 1
        try:
            yield self.step_proto(envs.initial())
            for action in requests:
                yield self.step_proto(envs.step(array_of(action.nest_action.array)))
        finally:
            envs.close()

    def stop(self):
        self.server.stop(grace=None).wait(30)


def main():
    address = sys.argv[1]
    num_envs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rpcenv = rpcenv_modules(tempfile.mkdtemp(prefix="rpcenv-"))
    server = OldBatchedServer(rpcenv, address, num_envs)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("serving", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
