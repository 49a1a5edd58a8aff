"""python -m bench.drift: how CartPole's greedy policy fails while it learns, over seeds.

CartPole ends an episode when the pole tips past 12 degrees or the cart leaves the track
(|x| > 2.4). Each seed trains `python -m monobeast --env CartPole-v1` with offline greedy
evaluation (--eval_interval_steps, --eval_episodes) and a wrapper (beast/envs.py WRAPPERS)
that writes down how every evaluation episode ended: at the time limit, the cart off the
track to the left or to the right, or the pole down. Per seed, one line of evaluations:

  0.38:10L  0.40:ok  0.43:10R  ...   (step in millions: ok = every episode reached the
                                       limit; 10L = 10 ended with the cart off the left end)

and totals over the seeds: how the failed episodes ended, and how often the side the cart
left on switched between one failed evaluation and the next.

  python -m bench.drift                                # seeds 0..4, repo defaults
  python -m bench.drift --seeds 0,1 -- --learning_rate 0.003
"""

import argparse
import collections
import csv
import functools
import json
import os
import subprocess
import sys

import gymnasium

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python -m bench.drift` from another directory
    sys.path.insert(0, REPO)

from beast import flags as beast_flags  # noqa: E402

from bench.launch import split_argv  # noqa: E402


class EndLog(gymnasium.Wrapper):
    """Appends one JSON line per finished episode to `path`: "limit", "left", "right" or
    "pole". Only in the process `pid` (the learner's, which plays the evaluations): the
    actor processes, forked from it, inherit the wrapper but write nothing."""

    def __init__(self, env, path, pid):
        super().__init__(env)
        self.path, self.pid = path, pid

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if (terminated or truncated) and os.getpid() == self.pid:
            x, bound = float(obs[0]), self.env.unwrapped.x_threshold
            end = ("pole" if abs(x) <= bound else "left" if x < 0 else "right") if terminated else "limit"
            with open(self.path, "a") as f:
                f.write(json.dumps({"end": end}) + "\n")
        return obs, reward, terminated, truncated, info


def train_one(trace_path, argv):
    """Runs MonoBeast in this process with EndLog around every environment."""
    from beast import envs
    import monobeast

    envs.WRAPPERS = (functools.partial(EndLog, path=trace_path, pid=os.getpid()),)
    return monobeast.main(argv)


def evaluations(run_dir, trace_path):
    """[(step, Counter of ends)] for each evaluation of the run, in order: the rows of logs.csv
    with an eval return, each owning the next eval_episodes lines of the trace."""
    with open(os.path.join(run_dir, "logs.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("eval_mean_episode_return")]
    with open(trace_path) as f:
        ends = [json.loads(line)["end"] for line in f]
    found, i = [], 0
    for row in rows:
        n = int(float(row["eval_episodes"]))
        found.append((int(row["step"]), collections.Counter(ends[i:i + n])))
        i += n
    return found


def label(counter):
    failed = {k: v for k, v in counter.items() if k != "limit"}
    if not failed:
        return "ok"
    return "+".join(f"{v}{k[0].upper()}" for k, v in sorted(failed.items()))


def report(per_seed, window):
    """Markdown lines: each seed's evaluations within window, then the totals over seeds."""
    lines, totals, flips, pairs = [], collections.Counter(), 0, 0
    for seed, evals in per_seed:
        shown = [(s, c) for s, c in evals if window[0] <= s <= window[1]]
        lines.append(f"seed {seed}: " + " ".join(f"{s / 1e6:.2f}:{label(c)}" for s, c in shown))
        sides = []
        for _, c in shown:
            totals.update(c)
            if c["left"] + c["right"] > 0:
                sides.append("left" if c["left"] >= c["right"] else "right")
        pairs += max(len(sides) - 1, 0)
        flips += sum(a != b for a, b in zip(sides, sides[1:]))
    failed = totals["left"] + totals["right"] + totals["pole"]
    lines.append("")
    lines.append(f"Evaluation episodes from {window[0] / 1e6:.2f}M to {window[1] / 1e6:.2f}M steps: "
                 f"{totals['limit']} reached the time limit, {failed} failed: cart off the left "
                 f"end {totals['left']}, off the right end {totals['right']}, pole down "
                 f"{totals['pole']}. Between one evaluation with a cart off the track and the "
                 f"next, the side switched {flips} times of {pairs}.")
    return lines


def main(argv=None):
    argv, extra = split_argv(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(
        prog="python -m bench.drift",
        usage="python -m bench.drift [options] [-- extra monobeast flags]",
        description="Trains CartPole-v1 with greedy evaluations and counts how their episodes "
                    "end (time limit, cart off the left or right end, pole down).",
        formatter_class=beast_flags.HelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="Comma-separated seeds, one after another.")
    parser.add_argument("--savedir", default=os.path.expanduser("~/logs/beast-drift"),
                        help="Where the runs go: savedir/drift-s<seed>/, with trace.jsonl.")
    parser.add_argument("--eval_interval_steps", type=int, default=25_000,
                        help="Steps between evaluations (passed on).")
    parser.add_argument("--eval_episodes", type=int, default=10, help="Episodes per evaluation.")
    parser.add_argument("--window", default="100000,1000000",
                        help="FIRST,LAST: the steps whose evaluations the report shows.")
    parser.add_argument("--train", default=None, help=argparse.SUPPRESS)  # internal: one run
    args = parser.parse_args(argv)
    if args.train:
        return train_one(args.train, extra)
    if any(arg == "--env" or arg.startswith("--env=") for arg in extra):
        parser.error("it trains CartPole-v1 only (the track and the pole are CartPole's): "
                     "drop --env from the flags after --")
    per_seed = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        xpid = f"drift-s{seed}"
        run_dir = os.path.join(args.savedir, xpid)
        trace = os.path.join(run_dir, "trace.jsonl")
        if os.path.exists(os.path.join(run_dir, "logs.csv")):
            print(f"seed {seed}: {run_dir} exists; reporting on it", file=sys.stderr)
        else:
            os.makedirs(run_dir, exist_ok=True)
            command = [sys.executable, "-m", "bench.drift", "--train", trace, "--",
                       "--env", "CartPole-v1", "--seed", str(seed), "--xpid", xpid,
                       "--savedir", args.savedir, "--no_progress",
                       "--eval_interval_steps", str(args.eval_interval_steps),
                       "--eval_episodes", str(args.eval_episodes), *extra]
            subprocess.run(command, cwd=REPO, check=True)
        per_seed.append((seed, evaluations(run_dir, trace)))
    first, last = (int(float(v)) for v in args.window.split(","))
    print("\n".join(report(per_seed, (first, last))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
