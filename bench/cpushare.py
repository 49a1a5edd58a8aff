"""Where the cores go in a running training: CPU time per process role, and idle time.

    python -m bench.cpushare polybeast CartPole-v1
    python -m bench.cpushare monobeast ALE/Pong-v5 --warmup_s 25 -- --precision bf16

Starts `python -m <variant> --env <env>` (flags after `--` go to it), waits --warmup_s,
reads the CPU time of every thread of the learner process and of its descendants (env
servers, actor processes, PolyBeast's acting process) from /proc, waits --window_s, reads
again, and stops the run.
Prints the SPS over the window (from logs.csv), and for each role and thread name the cores
it kept busy and its core-microseconds per environment step. The runs name their threads
(learner-<i>, inference-<i>, PolyBeast's C++ actor-<i> threads, MonoBeast's actor-<i>
processes; the env servers' stepping runs in their env-stream threads, or in gRPC's
grpcpp_sync_ser threads with --local_transport grpc), and threads
of one name add up. The sum against the machine's cores is
the idle share: a run that keeps 1.5 of 2 cores busy is waiting on something (a round
trip, a queue, a lock) for a quarter of the machine, which no faster kernel fixes. Last, the
mean learner_wait of the window's logs.csv rows: how much of its time the learner waited for
the actors' batches.
Linux only (/proc).
"""

import argparse
import collections
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from beast import machine
from beast import runlog

from bench import endtoend
from bench.launch import split_argv


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m bench.cpushare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=["monobeast", "polybeast"], help="The learner.")
    parser.add_argument("env", help="--env of the run.")
    parser.add_argument("--warmup_s", type=float, default=10.0,
                        help="Seconds after launch before the window opens (start-up and "
                             "the first updates are not what a run costs).")
    parser.add_argument("--window_s", type=float, default=25.0,
                        help="Seconds of the measured window.")
    parser.add_argument("--log_interval_steps", type=int, default=10_000,
                        help="The run's logs.csv interval: the window's SPS is read from the "
                             "rows at its ends, so a few rows should fall in it.")
    return parser


def descendants(root):
    """root and every process below it, from /proc's parent links."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass  # gone meanwhile
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier += children
    return found


def cpu_seconds(root):
    """{(pid, tid): (role, thread name, user + system CPU seconds)} for root's tree. Role:
    "learner process" for root, "children" (env servers, actors, PolyBeast's acting process) for
    the rest."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for pid in descendants(root):
        role = "learner process" if pid == root else "children (servers, actors, acting)"
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            times[(pid, int(tid))] = (role, name, (int(fields[11]) + int(fields[12])) / tick)
    return times


def read_rows(logs):
    """The logs.csv rows so far ([] before the first)."""
    try:
        return runlog.read_logs(logs)
    except OSError:
        return []


def last_row(rows):
    """(step, _time) of the last row, or None."""
    return (int(rows[-1]["step"]), rows[-1]["_time"]) if rows else None


def learner_wait(rows, start, end):
    """The mean learner_wait of the rows written in (start, end] (_time), or None: the share of
    the learner's time it waited for the actors' batches."""
    waits = [row["learner_wait"] for row in rows
             if start < row["_time"] <= end and not math.isnan(row.get("learner_wait", math.nan))]
    return sum(waits) / len(waits) if waits else None


def measure(flags):
    """Runs the learner and returns (sps, {(role, thread name): cores busy}, cores,
    learner_wait over the window or None)."""
    savedir = tempfile.mkdtemp(prefix="cpushare-")
    workload = endtoend.Workload("run", flags.variant, flags.env, "", flags.run_flags)
    logs = os.path.join(savedir, workload.key, "logs.csv")
    command = endtoend.training_command(workload, flags.log_interval_steps, savedir)
    # Output to a file, not a pipe: a pipe nobody reads fills up and stalls the run.
    output_path = os.path.join(savedir, "output.txt")
    with open(output_path, "w") as output:
        process = subprocess.Popen(command, cwd=endtoend.REPO, stdout=output, stderr=output,
                                   start_new_session=True)
    try:
        time.sleep(flags.warmup_s)
        if process.poll() is not None:
            with open(output_path, errors="replace") as output:
                sys.exit(f"the run ended during the warm-up:\n{output.read()[-3000:]}")
        before, row0, t0 = cpu_seconds(process.pid), last_row(read_rows(logs)), time.monotonic()
        time.sleep(flags.window_s)
        after, rows, t1 = cpu_seconds(process.pid), read_rows(logs), time.monotonic()
        row1 = last_row(rows)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # the run and all its processes have ended already
        process.wait(60)
        shutil.rmtree(savedir, ignore_errors=True)
    if row0 is None or row1 is None or row1[1] <= row0[1]:
        sys.exit("no two logs.csv rows in the window: raise --warmup_s or --window_s, or "
                 "lower --log_interval_steps")
    sps = (row1[0] - row0[0]) / (row1[1] - row0[1])
    busy = collections.defaultdict(float)
    for key, (role, name, seconds) in after.items():
        busy[(role, name)] += (seconds - before.get(key, (role, name, 0.0))[2]) / (t1 - t0)
    return sps, busy, machine.cores(), learner_wait(rows, row0[1], row1[1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, run_flags = split_argv(argv)  # everything after `--` goes to the learner
    flags = make_parser().parse_args(ours)
    flags.run_flags = run_flags
    sps, busy, cores, wait = measure(flags)
    print(f"{flags.variant} {flags.env} {' '.join(flags.run_flags)}".rstrip())
    print(f"  SPS {sps:,.0f} over {flags.window_s:g} s; {cores} cores")
    print(f"  {'role':30s} {'thread':16s} {'cores busy':>10s} {'core-us/step':>13s}")
    for (role, name), share in sorted(busy.items(), key=lambda item: -item[1]):
        if share >= 0.01:
            print(f"  {role:30s} {name:16s} {share:10.2f} {share / sps * 1e6:13.2f}")
    total = sum(busy.values())
    print(f"  {'all':30s} {'':16s} {total:10.2f} {total / sps * 1e6:13.2f}")
    print(f"  idle: {max(0.0, cores - total):.2f} of {cores} cores")
    if wait is not None:
        print(f"  learner waited for batches {wait:.1%} of its time (learner_wait; near 0 the "
              "learner is what the run waits for)")


if __name__ == "__main__":
    main()
