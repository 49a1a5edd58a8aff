"""python -m bench.nethack_ends: how a NetHack run's checkpoint ends its games.

A task's return alone does not say it: on NetHackStaircase-v0 a game that reaches the stairs
after many steps on which the clock stood still can score below one that dies early. This
plays `python -m monobeast --mode test` with the arguments given, with one more wrapper in
beast.envs.WRAPPERS that reads NLE's end_status at each game's end (TASK_SUCCESSFUL, DEATH,
ABORTED at the step limit), and prints how many games ended each way, and which actions the
policy took how often (a policy can lose to random actions by favouring a few: waiting,
searching, walking into walls).

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
    reports one, else "terminated" or "truncated"; and to `actions` (a Counter, optional)
    each action taken, by its NLE name where the env has one."""

    def __init__(self, env, ends, actions=None):
        super().__init__(env)
        self.ends = ends
        self.actions = actions
        self.names = getattr(env.unwrapped, "actions", None)

    def step(self, action):
        if self.actions is not None:
            name = self.names[int(action)] if self.names is not None else int(action)
            if hasattr(name, "name"):  # an enum member: CompassDirectionLonger.N, not N alone
                name = f"{type(name).__name__}.{name.name}"
            self.actions[str(name)] += 1
        observation, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            status = info.get("end_status")
            self.ends[getattr(status, "name", "truncated" if truncated else "terminated")] += 1
        return observation, reward, terminated, truncated, info


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ends, actions = collections.Counter(), collections.Counter()  # over every test env
    envs.WRAPPERS = (*envs.WRAPPERS, functools.partial(CountEnds, ends=ends, actions=actions))
    code = monobeast.main(["--mode", "test", *argv])
    if code == 0:
        print(f"Ends of {sum(ends.values())} games: {shares(ends)}")
        print(f"Actions taken ({sum(actions.values())} steps): {shares(actions)}")
    return code


def shares(counter):
    """"NAME count (share), ..." for a Counter, the most common first."""
    total = sum(counter.values())
    return ", ".join(f"{name} {count} ({count / total:.0%})" for name, count in
                     counter.most_common())


if __name__ == "__main__":
    sys.exit(main())
