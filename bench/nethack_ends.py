"""python -m bench.nethack_ends: how a NetHack run's checkpoint ends its games.

A task's return alone does not say it: on NetHackStaircase-v0 a game that reaches the stairs
after many steps on which the clock stood still can score below one that dies early. This
plays `python -m monobeast --mode test` with the arguments given, with one more wrapper in
beast.envs.WRAPPERS that reads NLE's end_status at each game's end (TASK_SUCCESSFUL, DEATH,
ABORTED at the step limit), and prints how many games ended each way.

    python -m bench.nethack_ends --xpid stair-s0 --test_episodes 100 --eval_policy sample
"""

import collections
import sys

import gymnasium

import monobeast
from beast import envs

ENDS = collections.Counter()  # end_status name -> games, over every environment made here


class CountEnds(gymnasium.Wrapper):
    """Counts the end_status (NLE's info) of each game that ends."""

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            status = info.get("end_status")
            ENDS[getattr(status, "name", "truncated" if truncated else "terminated")] += 1
        return observation, reward, terminated, truncated, info


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    envs.WRAPPERS = (*envs.WRAPPERS, CountEnds)
    code = monobeast.main(["--mode", "test", *argv])
    if code == 0:
        games = sum(ENDS.values())
        print(f"Ends of {games} games: " + ", ".join(
            f"{name} {count} ({count / games:.0%})" for name, count in ENDS.most_common()))
    return code


if __name__ == "__main__":
    sys.exit(main())
