"""What a PolyBeast run does when the link to its env servers drops and comes back.

    python -m bench.partition                         # cuts of 5 s, 60 s and 10 minutes
    python -m bench.partition --cuts 5,60 --gap_s 60 --output report.md

Two hosts on this machine (bench/netns.py, root only): env servers on host 0, a CartPole
learner on host 1, over TCP. After --warmup_s the link is cut (host 1's veth set down) for
each of --cuts in turn, --gap_s apart. From logs.csv: the SPS over the --window_s before
each cut, how long after the link came back the step counter moved again, and the SPS over
the --window_s that start there; and whether the run was still training at the end.
Measured, not asserted; run it alone on the machine.
"""

import argparse
import csv
import os
import signal
import subprocess
import sys
import tempfile
import time

from beast import machine
from bench import netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(run_dir):
    path = os.path.join(run_dir, "logs.csv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(float(r["_time"]), int(r["step"])) for r in csv.DictReader(f) if r.get("sps")]


def sps_between(logged, start, end):
    """Steps per second between the rows nearest to the wall times start and end."""
    inside = [(t, s) for t, s in logged if start <= t <= end]
    if len(inside) < 2:
        return float("nan")
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def start(hosts, workdir, port, learner_args):
    env = dict(os.environ, TMPDIR=workdir, PYTHONPATH=REPO)
    addresses = [f"{hosts.address[0]}:{port}", f"{hosts.address[0]}:{port + 1}"]
    hosts.popen(0, [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1",
                    "--num_servers", "2", "--address", addresses[0]],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    err = open(os.path.join(workdir, "learner.err"), "w")
    learner = hosts.popen(1, [sys.executable, "-m", "polybeast", "--env", "CartPole-v1",
                              "--savedir", os.path.join(workdir, "runs"), "--xpid", "run",
                              "--no_progress", "--server_addresses", ",".join(addresses),
                              "--total_steps", str(10**12), "--log_interval_steps", "5000",
                              *learner_args],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return learner, os.path.join(workdir, "runs", "run")


def measure(cuts, warmup_s, gap_s, window_s, learner_args, port):
    events = []
    with tempfile.TemporaryDirectory() as workdir, netns.Hosts() as hosts:
        learner, run_dir = start(hosts, workdir, port, learner_args)
        time.sleep(warmup_s)
        for seconds in cuts:
            down = time.time()
            hosts.link(1, up=False)
            time.sleep(seconds)
            hosts.link(1, up=True)
            events.append((seconds, down, time.time()))
            time.sleep(gap_s)
        alive = learner.poll() is None
        learner.send_signal(signal.SIGTERM)
        learner.wait(120)
        logged = rows(run_dir)
        with open(os.path.join(workdir, "learner.err")) as f:
            err = f.read()
    return events, logged, alive, learner.returncode, err


def report(events, logged, alive, returncode, err, window_s, args):
    lines = ["# PolyBeast across a link that drops", "",
             f"- command: `python -m bench.partition {' '.join(args)}`",
             "- machine: " + ", ".join(f"{k} {v}" for k, v in machine.describe().items())
             + f"; date {time.strftime('%Y-%m-%d')}",
             f"- the learner was still training at the end: {'yes' if alive else 'no'}; "
             f"it exited with {returncode} on SIGTERM; steps logged: {logged[-1][1]:,}",
             f"- 'reconnected' lines: {err.count('reconnected')}; checkpoints written in a "
             f"stall: {err.count('Waiting for rollouts')}", "",
             "| cut | SPS before | steps during the cut | first step after the link is back "
             f"| SPS over the {window_s:g} s from then | after / before |",
             "|---|---|---|---|---|---|"]
    for seconds, down, up in events:
        before = sps_between(logged, down - window_s, down)
        during = [s for t, s in logged if down <= t <= up]
        moved = next((t for t, s in logged if t > up and s > (during[-1] if during else 0)),
                     None)
        after = sps_between(logged, moved, moved + window_s) if moved else float("nan")
        during_steps = (during[-1] - during[0]) if len(during) > 1 else 0
        lines.append(f"| {seconds:g} s | {before:,.0f} | {during_steps:,} | "
                     f"{'never' if moved is None else f'{moved - up:.1f} s'} | {after:,.0f} | "
                     f"{after / before:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", default="5,60,600",
                        help="Comma-separated lengths of the partitions, in seconds.")
    parser.add_argument("--warmup_s", type=float, default=60.0,
                        help="Training before the first cut.")
    parser.add_argument("--gap_s", type=float, default=90.0,
                        help="Training after each cut before the next (and before the end).")
    parser.add_argument("--window_s", type=float, default=30.0,
                        help="The span over which the SPS before and after a cut is taken.")
    parser.add_argument("--port", type=int, default=4300, help="The servers' first port.")
    parser.add_argument("--output", default=None, help="Also write the report here.")
    parser.add_argument("learner_args", nargs="*", help="More flags for the learner (after --).")
    args = parser.parse_args(argv)
    problem = netns.reason()
    if problem:
        parser.error(problem)
    cuts = [float(c) for c in args.cuts.split(",") if c]
    text = report(*measure(cuts, args.warmup_s, args.gap_s, args.window_s, args.learner_args,
                           args.port), args.window_s, sys.argv[1:] if argv is None else argv)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
