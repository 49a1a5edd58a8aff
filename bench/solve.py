"""python -m bench.solve: wall time from launch until a run "solves" its task, over seeds.

Each seed runs `python -m monobeast` (or polybeast) as a user would, in a
subprocess with its own --savedir in a temporary directory. logs.csv is watched
as it grows; the run gets SIGTERM as soon as a row's mean_episode_return (the
mean of the last 100 finished episodes) reaches --target, or once --time_limit_s
has passed since launch. The time to target is the row's _time minus the launch
time, so it includes start-up and does not depend on how often we poll.

By default the run keeps the repo's own --total_steps, because the learning
rate decays to zero over it: a user's `python -m monobeast --env CartPole-v1`
is what is measured, and a run that ends before the target counts as a failure.
Pass --total_steps to run longer (e.g. 10**12 for a constant learning rate).

A run longer than one sitting allows (a GPU booked for minutes at a time) goes in pieces:
with --piece_s and a --workdir, each seed runs that long (or until its run logs a first row
of the piece, if that comes later), then is stopped with its checkpoint and the command
exits with 3; the same command again resumes it (the variants' own resume, same --xpid).
Its wall time is the sum of the pieces' (each from its launch, so each start-up counts),
and --time_limit_s bounds that sum. A seed's result, once known, is kept in the workdir
(solve.json), so a finished seed is reported, not run again.

  python -m bench.solve                                  # CartPole-v1, seeds 0..4
  python -m bench.solve --seeds 0,1 -- --learning_rate 0.01
  python -m bench.solve --variant polybeast --output solve.md
  python -m bench.solve --env ALE/Pong-v5 --target 18 --time_limit_s 3600 --piece_s 500 \
      --workdir runs/pong                 # again until it exits with 0 or 1
"""

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python -m bench.solve` from another directory
    sys.path.insert(0, REPO)

from beast import flags as beast_flags  # noqa: E402

from bench import endtoend  # noqa: E402
from bench.launch import split_argv, write_json  # noqa: E402


def make_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bench.solve",
        usage="python -m bench.solve [options] [-- extra monobeast/polybeast flags]",
        description="Wall time from launch until the mean return of the last 100 episodes "
                    "reaches a target, for several seeds, as a markdown table. Everything "
                    "after `--` is passed to the variant unchanged. Exits with 1 when a "
                    "seed does not reach the target.",
        formatter_class=beast_flags.HelpFormatter)
    parser.add_argument("--env", default="CartPole-v1", help="Environment id.")
    parser.add_argument("--variant", default="monobeast", choices=["monobeast", "polybeast"],
                        help="Which trainer to launch.")
    parser.add_argument("--seeds", default="0,1,2,3,4",
                        help="Comma-separated seeds, run one after another.")
    parser.add_argument("--target", type=float, default=475.0,
                        help="mean_episode_return that counts as solved (CartPole-v1: 475).")
    parser.add_argument("--time_limit_s", type=float, default=60.0,
                        help="Wall seconds from launch after which a run counts as failed.")
    parser.add_argument("--total_steps", type=int, default=None,
                        help="Pass this --total_steps to the run (default: none, so the "
                             "repo's default and its learning-rate schedule apply).")
    parser.add_argument("--poll_s", type=float, default=0.1,
                        help="How often logs.csv is read.")
    parser.add_argument("--output", default=None,
                        help="Also write the markdown report to this file.")
    parser.add_argument("--workdir", default=None,
                        help="Where the runs write, kept afterwards (default: a temporary "
                             "directory, removed at the end).")
    parser.add_argument("--piece_s", type=float, default=None,
                        help="Run a seed this many wall seconds per invocation (longer if its "
                             "run has logged no row yet in this one), then stop it with its "
                             "checkpoint and exit with 3; the same command "
                             "continues it. Needs --workdir. (default: no pieces)")
    return parser


def log(message):
    print(f"[solve {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# One run.

@dataclasses.dataclass
class SolveResult:
    seed: int
    solved: bool = False
    wall_s: float = math.nan  # launch -> the first row at or above the target
    steps: float = math.nan  # the step of that row
    best_mean: float = math.nan
    best_step: float = math.nan
    last_step: float = math.nan
    load1: float = math.nan  # 1-minute load average when the run was stopped
    note: str = ""
    paused: bool = False  # stopped after --piece_s: the same command continues it
    pieces: int = 0  # launches so far


def complete_rows(path):
    """The rows of a logs.csv that is still being written: a last line without
    its newline is left out, since a cut-off number would read as a smaller one."""
    try:
        with open(path, newline="") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    text = text[:text.rfind("\n") + 1]
    rows = []
    for record in csv.DictReader(io.StringIO(text)):
        try:
            rows.append(dict(_time=float(record["_time"]), step=float(record["step"]),
                             mean=float(record.get("mean_episode_return") or "nan")))
        except (KeyError, TypeError, ValueError):
            continue  # a header that is being rewritten as columns are added
    return rows


def elapsed_in(pieces, t):
    """Wall seconds of the run up to time t: pieces is [[launch, stop], ...] in order, the
    last one's stop may be math.inf (the piece running now). NaN before the first launch."""
    spent = 0.0
    for launch, stop in pieces:
        if t < launch:
            break
        if t <= stop:
            return spent + (t - launch)
        spent += stop - launch
    return math.nan


def update(result, rows, pieces, target, time_limit_s):
    """Folds logs.csv rows into result; True once a row reaches the target in time.
    pieces: the run's launches and stops, for the wall time of each row (elapsed_in)."""
    for row in rows:
        elapsed = elapsed_in(pieces, row["_time"])
        # No episode has ended yet, or the row came after the limit (we poll late).
        if math.isnan(row["mean"]) or not elapsed <= time_limit_s:
            continue
        if math.isnan(result.best_mean) or row["mean"] > result.best_mean:
            result.best_mean, result.best_step = row["mean"], row["step"]
        if row["mean"] >= target and not result.solved:
            result.solved = True
            result.wall_s = elapsed
            result.steps = row["step"]
    if rows:
        result.last_step = rows[-1]["step"]
    return result.solved


def command_for(args, extra, seed, savedir):
    command = [sys.executable, "-m", args.variant, "--env", args.env, "--seed", str(seed),
               "--savedir", savedir, "--xpid", f"seed{seed}", "--no_progress",
               "--checkpoint_interval_s", "1e9"]
    if args.total_steps is not None:
        command += ["--total_steps", str(args.total_steps)]
    return command + extra  # The user's flags come last, so they win.


def stop(process, timeout_s=60.0):
    """SIGTERM (the run checkpoints and exits), then the whole group is killed if need be."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


PIECES = "pieces.json"  # in a seed's savedir: [[launch, stop], ...] of its earlier pieces
RESULT = "solve.json"  # in a seed's savedir: its SolveResult, once it is known


def read_json(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def run_seed(args, extra, seed, workdir):
    """Launches one run (or its next piece) and watches it until it solves, fails, ends or
    its piece is over."""
    savedir = os.path.join(workdir, f"seed{seed}")
    os.makedirs(savedir, exist_ok=True)
    known = read_json(os.path.join(savedir, RESULT), None)
    if known is not None:  # finished in an earlier invocation
        return SolveResult(**known)
    logs_path = os.path.join(savedir, f"seed{seed}", "logs.csv")
    pieces = read_json(os.path.join(savedir, PIECES), [])
    spent = sum(stop - launch for launch, stop in pieces)
    piece_s = min(args.time_limit_s - spent, args.piece_s or math.inf)
    result = SolveResult(seed=seed, pieces=len(pieces) + 1)
    rows_before = len(complete_rows(logs_path))
    with open(os.path.join(workdir, f"seed{seed}.out"), "a") as out:
        launch_time, launch = time.time(), time.monotonic()
        running = [*pieces, [launch_time, math.inf]]
        # Its own session, so that a run that ignores SIGTERM can be killed with its actors.
        process = subprocess.Popen(command_for(args, extra, seed, savedir), cwd=REPO,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                code = process.poll()
                # Read after poll: rows written just before the exit still count.
                rows = complete_rows(logs_path)
                if update(result, rows, running, args.target, args.time_limit_s):
                    break
                if code is not None:
                    result.note = (f"run ended at step {fmt(result.last_step, 0)}" if code == 0
                                   else f"exited with status {code}: "
                                   + endtoend._tail(out.name, 300).strip().replace("\n", " / "))
                    break
                if spent + time.monotonic() - launch > args.time_limit_s:
                    result.note = f"time limit, at step {fmt(result.last_step, 0)}"
                    break
                # A piece stopped before its run logs a row of its own would stop a run
                # still starting (its checkpoint not yet written): the next piece would start
                # afresh instead of resuming.
                if time.monotonic() - launch > piece_s and len(rows) > rows_before:
                    result.paused = True
                    result.note = (f"paused at step {fmt(result.last_step, 0)} after "
                                   f"{spent + time.monotonic() - launch:.0f} s in "
                                   f"{result.pieces} piece(s): the same command continues it")
                    break
                time.sleep(args.poll_s)
            result.load1 = endtoend.load_average()
        finally:
            stopped = time.time()  # the checkpoint written on the way out is not training
            stop(process)
            write_json(os.path.join(savedir, PIECES), [*pieces, [launch_time, stopped]])
    if not result.solved and math.isfinite(result.best_step):
        result.note += f"; best at step {result.best_step:.0f}"
    if not result.paused:
        write_json(os.path.join(savedir, RESULT), dataclasses.asdict(result))
    return result


# ---------------------------------------------------------------------------------------------
# The report.

def fmt(x, digits=1):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def report(args, extra, results, argv):
    rows = ["| seed | solved | wall s to target | steps to target | best mean | load1 | note |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        state = "yes" if r.solved else "paused" if r.paused else "no"
        rows.append(f"| {r.seed} | {state} | {fmt(r.wall_s)} | "
                    f"{fmt(r.steps, 0)} | {fmt(r.best_mean)} | {fmt(r.load1, 2)} | {r.note} |")
    # A failure counts as infinitely slow: the median says whether most seeds solve.
    times = [r.wall_s if r.solved else math.inf for r in results]
    # The worst is the slowest success, or else the failure that got least far.
    worst = max(results, key=lambda r: (not r.solved, r.wall_s if r.solved else
                                        -(r.best_mean if math.isfinite(r.best_mean) else -1e9)))
    worst_text = (f"{worst.wall_s:.1f} s (seed {worst.seed})" if worst.solved else
                  f"not solved (seed {worst.seed}, best mean {fmt(worst.best_mean)})")
    median = statistics.median(times)
    median_text = f"{median:.1f} s" if math.isfinite(median) else "not solved"
    solved = sum(r.solved for r in results)
    waiting = [seed for seed in map(int, args.seeds.split(",")) if seed not in
               {r.seed for r in results}]
    lines = [f"## {args.variant} {args.env}: mean return >= {args.target:g} "
             f"within {args.time_limit_s:g} s",
             "",
             *rows,
             "",
             (f"Solved {solved}/{len(results)}; median {median_text}; worst {worst_text}."
              if not results[-1].paused else
              f"Not finished: seed {results[-1].seed} paused after {results[-1].pieces} "
              f"piece(s)" + (f", seeds {', '.join(map(str, waiting))} not started"
                             if waiting else "") + "; the same command continues."),
             "",
             "Command: `" + " ".join(shlex.quote(a) for a in ["python", "-m", "bench.solve", *argv])
             + "`",
             "Each run: `" + " ".join(shlex.quote(a) for a in
                                     ["python", *command_for(args, extra, "SEED", "DIR")[1:]])
             + "`"]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = split_argv(argv)
    parser = make_parser()
    args = parser.parse_args(ours)
    if args.piece_s is not None and not args.workdir:
        parser.error("--piece_s needs --workdir: the next piece resumes the run kept there")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="beast-solve-") as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        results = []
        for seed in seeds:
            result = run_seed(args, extra, seed, workdir)
            log(f"seed {seed}: " + (f"solved in {result.wall_s:.1f} s at step {result.steps:.0f}"
                                    if result.solved else
                                    f"not solved ({result.note}); best mean "
                                    f"{fmt(result.best_mean)}"))
            results.append(result)
            if result.paused:  # one piece per invocation: the rest wait for the next ones
                break
    text = report(args, extra, results, argv)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if results[-1].paused:
        return 3
    return 0 if all(r.solved for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
