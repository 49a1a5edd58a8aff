"""python -m bench.random_agent: the return of uniformly random actions, the floor a learning
curve is read against.

The environment is the one training makes (beast.envs.create_env), so its reward and its
episode ends are the learner's; Atari's episodes are whole games. Each episode is seeded
(--seed, --seed + 1, ...) and so are the actions, so the same command prints the same
numbers. So is how the games ended (bench.nethack_ends.CountEnds: NLE's end_status where
the env reports one, else terminated or truncated).

    python -m bench.random_agent --env NetHackScore-v0 --episodes 100
    python -m bench.random_agent --env MinAtar/Breakout-v1 --episodes 30 --seed 10
"""

import argparse
import collections
import statistics
import sys
import time

from beast import envs
from beast import flags as beast_flags
from bench import nethack_ends


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m bench.random_agent",
                                     description=__doc__.split("\n\n")[0])
    beast_flags.add_env_flags(parser)
    parser.add_argument("--episodes", type=beast_flags.Number(int, low=1), default=30,
                        help="Episodes to play.")
    parser.add_argument("--seed", type=int, default=0,
                        help="The first episode's seed; the actions are drawn from it too.")
    return parser


def play(env, episodes, seed):
    """[(return, length)] of `episodes` episodes of uniformly random actions."""
    env.action_space.seed(seed)
    played = []
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        total, length, done = 0.0, 0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            total, length = total + float(reward), length + 1
            done = terminated or truncated
        played.append((total, length))
    return played


def summary(played):
    """One line: the mean return with its standard deviation and its median (a few long games
    can carry a mean), and the episodes' lengths."""
    returns = [r for r, _ in played]
    lengths = [n for _, n in played]
    spread = statistics.stdev(returns) if len(returns) > 1 else 0.0
    return (f"return {statistics.mean(returns):.1f} ± {spread:.1f} (median "
            f"{statistics.median(returns):.1f}, min {min(returns):.1f}, max {max(returns):.1f}) "
            f"over {len(played)} episodes; length "
            f"{statistics.mean(lengths):.0f} (min {min(lengths)}, max {max(lengths)})")


def main(argv=None):
    flags = make_parser().parse_args(argv)
    flags.episodic_life = False  # whole games: the return a curve reports
    try:
        env = envs.create_env(flags)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    ends = collections.Counter()
    played = play(nethack_ends.CountEnds(env, ends), flags.episodes, flags.seed)
    env.close()
    steps = sum(n for _, n in played)
    print(f"{flags.env}, uniformly random actions: {summary(played)}; "
          f"{steps / (time.monotonic() - start):,.0f} steps/s")
    print("Ends of the games: " + ", ".join(f"{name} {count}"
                                           for name, count in ends.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
