"""python -m bench.nethack_ends: how a NetHack run's checkpoint ends its games.

A task's return alone does not say it: on NetHackStaircase-v0 a game that reaches the stairs
after many steps on which the clock stood still can score below one that dies early. This
plays `python -m monobeast --mode test` with the arguments given, with one more wrapper in
beast.envs.WRAPPERS that reads NLE's end_status at each game's end (TASK_SUCCESSFUL, DEATH,
ABORTED at the step limit), and prints how many games ended each way.

    python -m bench.nethack_ends --xpid stair-s0 --test_episodes 100 --eval_policy sample
"""

import collections
import functools
import sys

import gymnasium

import monobeast
from beast import envs

class CountEnds(gymnasium.Wrapper):
    """Adds to `ends` (a Counter) how each game ends: NLE's end_status name where the env
    reports one, else "terminated" or "truncated"."""

    def __init__(self, env, ends):
        super().__init__(env)
        self.ends = ends

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            status = info.get("end_status")
            self.ends[getattr(status, "name", "truncated" if truncated else "terminated")] += 1
        return observation, reward, terminated, truncated, info


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ends = collections.Counter()  # over every environment the test makes
    envs.WRAPPERS = (*envs.WRAPPERS, functools.partial(CountEnds, ends=ends))
    code = monobeast.main(["--mode", "test", *argv])
    if code == 0:
        games = sum(ends.values())
        print(f"Ends of {games} games: " + ", ".join(
            f"{name} {count} ({count / games:.0%})" for name, count in ends.most_common()))
    return code


if __name__ == "__main__":
    sys.exit(main())
