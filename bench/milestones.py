"""python -m bench.milestones: where runs stood after so many minutes of training, as a table.

For each run directory: the 100-episode mean return at the given minutes of training (and,
with --steps, at given environment steps, which compare runs on machines of different speed), when
(minutes and steps) it first reached each threshold, its steps and SPS, the mean game length
at its end, and the latest `--mode test` of its final checkpoint, sampled and greedy. Minutes
count training as `beast.plot --x _time` does: from each launch, start-up included, the
pauses between a stop and its resume left out (runlog.training_seconds).

  python -m bench.milestones ~/logs/beast/pong-s0 ~/logs/beast/pong-s1 --thresholds=-19,0,18
"""

import argparse
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python -m bench.milestones` from another directory
    sys.path.insert(0, REPO)

from beast import runlog  # noqa: E402

from bench.learn import drop_superseded, finite_value, latest_test  # noqa: E402

# A run that ended less than this before a milestone still reports its last row there: a run
# stopped by `timeout 3600` logs its last row a few seconds short of the hour.
GRACE_S = 60.0


def training_rows(path):
    """The run's training rows (no evaluation rows), in time order, without those a resume
    made stale. Raises FileNotFoundError without a logs.csv."""
    rows = drop_superseded(runlog.read_logs(os.path.join(path, "logs.csv")))
    return [r for r in rows if not finite_value(r, "eval_mean_episode_return")]


def milestones(path, minutes, thresholds, steps=()):
    """What the run at path had reached: see the module's docstring. Returns a dict with
    returns {minute: return or None}, at_steps {step: return or None}, firsts {threshold:
    (seconds, step) or None}, seconds, steps, length (the last row's mean_episode_length) and
    tests {policy: record or None}."""
    rows = training_rows(path)
    if not rows:
        raise ValueError(f"{path}: logs.csv has no training rows")
    seconds = runlog.training_seconds([r["_time"] for r in rows], runlog.start_times(path))
    timed = [(t, r) for t, r in zip(seconds, rows) if finite_value(r, "mean_episode_return")]
    returns = {}
    for minute in minutes:
        before = [r for t, r in timed if t <= minute * 60]
        reached = seconds[-1] + GRACE_S >= minute * 60
        returns[minute] = before[-1]["mean_episode_return"] if before and reached else None
    # A run that stopped short of a step has no return there; otherwise its last row at or
    # before the step (rows come every few thousand steps).
    at_steps = {}
    for step in steps:
        before = [r for _, r in timed if r["step"] <= step]
        reached = rows[-1]["step"] >= step
        at_steps[step] = before[-1]["mean_episode_return"] if before and reached else None
    firsts = {th: next(((t, r["step"]) for t, r in timed if r["mean_episode_return"] >= th),
                       None) for th in thresholds}
    return dict(returns=returns, at_steps=at_steps, firsts=firsts, seconds=seconds[-1],
                steps=rows[-1]["step"], length=rows[-1].get("mean_episode_length", math.nan),
                tests={policy: latest_test(path, policy) for policy in ("sample", "greedy")})


def fmt_first(first):
    return "-" if first is None else f"{first[0] / 60:.0f} min, {first[1] / 1e6:.2f}M"


def fmt_test(record, steps):
    """A test's mean return and its number of games; a test of an earlier checkpoint than the
    run's last row is marked with its step."""
    if record is None:
        return "-"
    returns = record["returns"]
    text = f"{sum(returns) / len(returns):+.1f} ({len(returns)})"
    return text if record["step"] >= steps else f"{text} at {record['step'] / 1e6:.2f}M"


def fmt_returns(returns, keys):
    return " / ".join("-" if returns[k] is None else f"{returns[k]:+.1f}" for k in keys)


def table(labels, results, minutes, thresholds, steps=()):
    """The markdown table, one row per run."""
    header = (["run", "return at " + " / ".join(f"{m:g}" for m in minutes) + " minutes"]
              + (["return at " + " / ".join(f"{s / 1e6:g}" for s in steps) + "M steps"]
                 if steps else [])
              + [f"first {th:+g}" for th in thresholds]
              + ["steps (SPS)", "game length at the end", "checkpoint, sampled (games)",
                 "checkpoint, greedy (games)"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, m in zip(labels, results):
        cells = [label, fmt_returns(m["returns"], minutes)]
        cells += [fmt_returns(m["at_steps"], steps)] if steps else []
        cells += [fmt_first(m["firsts"][th]) for th in thresholds]
        cells += [f"{m['steps'] / 1e6:.2f}M ({m['steps'] / m['seconds']:,.0f})",
                  f"{m['length']:,.0f}" if finite_value(m, "length") else "-"]
        cells += [fmt_test(m["tests"][policy], m["steps"]) for policy in ("sample", "greedy")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def numbers(text):
    return [float(x) for x in text.split(",") if x.strip()]


def make_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bench.milestones",
        description="Where runs stood after so many minutes of training (the pauses between "
                    "a stop and its resume left out): the return at each of --minutes, the "
                    "first time each of --thresholds was reached, and the final checkpoint's "
                    "latest tests, as a markdown table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="Run directories.")
    parser.add_argument("--minutes", type=numbers, default="20,30,40,50,60",
                        help="Minutes of training at which to read the return; a run that "
                             "ended more than a minute before one shows '-'.")
    parser.add_argument("--steps", type=numbers, default="",
                        help="Environment steps at which to read the return as well, e.g. "
                             "1e6,2e6,3e6; a run that stopped short of one shows '-'. Runs on "
                             "machines of different speed compare by steps, not minutes.")
    parser.add_argument("--thresholds", type=numbers, default="0",
                        help="Returns whose first crossing to report; with a negative first one, "
                             "write --thresholds=-19,0,18.")
    parser.add_argument("--labels", default=None,
                        help="Comma-separated row labels, one per run (default: the "
                             "directories' names).")
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    labels = (args.labels.split(",") if args.labels is not None
              else [os.path.basename(os.path.normpath(p)) for p in args.runs])
    if len(labels) != len(args.runs):
        parser.error(f"--labels gives {len(labels)} labels for {len(args.runs)} runs: "
                     "give one per run")
    results = []
    for path in args.runs:
        try:
            results.append(milestones(path, args.minutes, args.thresholds, args.steps))
        except (OSError, ValueError) as e:
            parser.error(f"cannot read {path}: {e}")
    print(table(labels, results, args.minutes, args.thresholds, args.steps))


if __name__ == "__main__":
    main()
