"""An env server whose CartPoles send what no learner should take, as a hand-written server
might: `done` as uint8 (one byte, not bool: ~done would be 254), a NaN in the observation, or
a last_action out of range. The learner must refuse each with one message.

    python -m tests.byte_done_server unix:/path/to/socket [done-uint8|nan-frame|bad-last-action]
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

    def __init__(self, envs_per_stream=None):  # what the learner asks for: ignored, 2
        flags = argparse.Namespace(env="CartPole-v1", env_backend="gymnasium")
        self.envs = vector_envs.create_vector_env(flags, self.num_envs, seed=0)

    fault = "done-uint8"

    def _cast(self, outputs):
        outputs = dict(outputs)
        if self.fault == "done-uint8":
            outputs["done"] = outputs["done"].astype(np.uint8)
        elif self.fault == "nan-frame":
            outputs["frame"] = outputs["frame"].copy()
            outputs["frame"][1, 2] = np.nan
        elif self.fault == "bad-last-action":
            outputs["last_action"] = np.full_like(outputs["last_action"], 7)
        return outputs

    def initial(self):
        return self._cast(self.envs.initial())

    def step(self, actions):
        return self._cast(self.envs.step(actions))

    def close(self):
        self.envs.close()


def main():
    if len(sys.argv) > 2:
        ByteDone.fault = sys.argv[2]
    server = libpolybeast.EnvServer(ByteDone, sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"serving at {sys.argv[1]}", flush=True)
    server.run()


if __name__ == "__main__":
    main()
