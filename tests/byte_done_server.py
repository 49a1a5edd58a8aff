"""An env server whose CartPoles send `done` as uint8 (one byte, not bool), as a hand-written
server in another language might. The learner must refuse it by name: as uint8, ~done is 254.

    python -m tests.byte_done_server unix:/path/to/socket
"""

import argparse
import signal
import sys

import numpy as np

import libpolybeast
from beast import vector_envs


class ByteDone:
    """Two CartPoles in a batch (Step.batch), with done cast to uint8."""

    num_envs = 2

    def __init__(self):
        flags = argparse.Namespace(env="CartPole-v1", env_backend="gymnasium")
        self.envs = vector_envs.create_vector_env(flags, self.num_envs, seed=0)

    def _cast(self, outputs):
        return dict(outputs, done=outputs["done"].astype(np.uint8))

    def initial(self):
        return self._cast(self.envs.initial())

    def step(self, actions):
        return self._cast(self.envs.step(actions))

    def close(self):
        self.envs.close()


def main():
    server = libpolybeast.EnvServer(ByteDone, sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"serving at {sys.argv[1]}", flush=True)
    server.run()


if __name__ == "__main__":
    main()
