"""python -m bench.launch: a grid of environments x variants x seeds, run on the local cores.

Each run is one subprocess, as a user would type it::

    python -m <variant> --env E --seed S --xpid <env>-<variant>-s<seed> --savedir DIR \\
        --no_progress [--total_steps N] [the grid's extra args] [the env's extra args]

(a "/" in the env id becomes "-" in the xpid, so MinAtar runs stay one folder deep). The data
path::

    grid (RunSpec per run) -> skip those whose logs.csv reaches their end (total_steps,
                              or --stop_at_steps: SIGTERM there, the schedule left long)
        -> at most --parallel children at once, each in its own session,
           stdout/stderr appended to savedir/xpid/stdout.txt, stderr.txt
        -> one RunResult per run (done, skipped, failed, stopped), also written to
           savedir/xpid/launch.json, so a later report knows how the last attempt ended

Resuming is the variants' own: a run launched again with the same xpid continues from its
checkpoint, so launching the same grid twice finishes what the first launch left. Ctrl-C (or
SIGTERM) stops every child with SIGTERM, upon which each writes its checkpoint; a child that
has not exited after --stop_timeout_s is killed with its process group.

    python -m bench.launch --envs CartPole-v1,Acrobot-v1 --seeds 0,1 --savedir ~/logs/grid
    python -m bench.launch --envs ALE/Pong-v5 --variants monobeast --seeds 1,2 \\
        --stop_at_steps 2000000 -- --entropy_cost 0.01
    python -m bench.launch --envs MinAtar/Breakout-v1 --variants polybeast \\
        --env_args "MinAtar/Breakout-v1=--num_actors 2" -- --use_lstm
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python -m bench.launch` from another directory
    sys.path.insert(0, REPO)

from beast import flags as beast_flags  # noqa: E402
from beast import machine  # noqa: E402
from beast import runlog  # noqa: E402

# The trainers a grid can run: the module, and what starts it. polybeast-2ranks is PolyBeast
# with two learner ranks on torch.distributed on this machine (torchrun --standalone picks a
# free rendezvous port, so several such runs can share the machine); --total_steps counts both
# ranks' steps, so its curves compare with one learner's step for step.
LAUNCHERS = {
    "monobeast": ("monobeast", ()),
    "polybeast": ("polybeast", ()),
    "polybeast-2ranks": ("polybeast", ("-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node=2")),
}
VARIANTS = tuple(LAUNCHERS)
DEFAULT_VARIANTS = ("monobeast", "polybeast")  # a grid runs these unless --variants says
STDERR_TAIL_LINES = 8  # of a failed run's stderr, kept in its result
STOP_TIMEOUT_S = 60.0  # SIGTERM -> exit; a run writes its checkpoint in between
LOOK_EVERY_S = 2.0  # how often a run with stop_at_steps has its logs.csv read


def default_parallel():
    """Half the cores: a run keeps about two busy (its actors, its learner); 1 on 2 cores."""
    return max(1, machine.cores() // 2)


# ---------------------------------------------------------------------------------------------
# The grid.

@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the grid. total_steps None: the variant's default for the env (the
    repo's ENV_DEFAULTS), which the run's flags.json records once it has started."""
    env: str
    variant: str
    seed: int
    total_steps: int = None
    args: tuple = ()  # extra flags: the grid's, then the env's (later ones win in argparse)
    # Stop the run with SIGTERM once its logs pass this step, its learning-rate schedule
    # still that of total_steps: the first steps of a long run, compared at a step count.
    stop_at_steps: int = None

    @property
    def xpid(self):
        return f"{self.env.replace('/', '-')}-{self.variant}-s{self.seed}"

    def command(self, savedir):
        """The argv that starts (or resumes) this run under savedir (an absolute path)."""
        module, launcher = LAUNCHERS[self.variant]
        command = [sys.executable, *launcher, "-m", module, "--env", self.env, "--seed",
                   str(self.seed), "--xpid", self.xpid, "--savedir", savedir, "--no_progress"]
        if self.total_steps is not None:
            command += ["--total_steps", str(self.total_steps)]
        return command + list(self.args)


def parse_env_args(items):
    """{env: [args]} from "ENV=ARGS" strings such as "MinAtar/Breakout-v1=--num_actors 2";
    the ARGS of an env given twice are joined. Raises ValueError for an item without "="."""
    env_args = {}
    for item in items or ():
        env, sep, text = item.partition("=")
        if not sep or not env.strip():
            raise ValueError(f"--env_args {item!r}: expected ENV=ARGS, e.g. "
                             "'MinAtar/Breakout-v1=--num_actors 2'")
        env_args.setdefault(env.strip(), []).extend(shlex.split(text))
    return env_args


def make_grid(envs, variants, seeds, total_steps=None, args=(), env_args=None,
              stop_at_steps=None):
    """RunSpecs for envs x variants x seeds, in that order (an env's seeds run together).

    Args:
      total_steps: an int or None for every env, or {env: int or None}.
      args: extra flags for every run.
      env_args: {env: [flags]}, appended after `args` for that env's runs.
      stop_at_steps: every run's RunSpec.stop_at_steps.
    """
    env_args = env_args or {}
    specs = []
    for env in envs:
        steps = total_steps.get(env) if isinstance(total_steps, dict) else total_steps
        for variant in variants:
            for seed in seeds:
                specs.append(RunSpec(env, variant, int(seed), steps,
                                     tuple(args) + tuple(env_args.get(env, ())),
                                     stop_at_steps))
    return specs


def share_cores(spec, parallel):
    """With several runs at once, each gets cores / parallel intra-op threads, unless its
    flags choose: by default a run's learner takes every core, and N of them would fight."""
    if parallel <= 1 or "--num_torch_threads" in " ".join(spec.args):
        return spec
    threads = max(1, machine.cores() // parallel)
    return dataclasses.replace(spec, args=spec.args + ("--num_torch_threads", str(threads)))


# ---------------------------------------------------------------------------------------------
# What a run folder says.

def run_dir(spec, savedir):
    return os.path.join(savedir, spec.xpid)


def logged_steps(path):
    """The largest step in path/logs.csv, or nan when there is none (or it cannot be read)."""
    try:
        rows = runlog.read_logs(os.path.join(path, "logs.csv"))
    except (OSError, ValueError):
        return math.nan
    steps = [r["step"] for r in rows if isinstance(r.get("step"), float)]
    return max(steps) if steps else math.nan


def target_steps(spec, savedir):
    """The run's total_steps: the spec's, else what its flags.json says (None if not yet run)."""
    if spec.total_steps is not None:
        return spec.total_steps
    try:
        with open(os.path.join(run_dir(spec, savedir), "flags.json")) as f:
            return int(json.load(f)["total_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def end_steps(spec, savedir):
    """Where the run ends: its stop_at_steps or its total_steps, whichever comes first (None
    if neither is known yet)."""
    total = target_steps(spec, savedir)
    if spec.stop_at_steps is None or total is None:
        return spec.stop_at_steps or total
    return min(spec.stop_at_steps, total)


def is_done(spec, savedir):
    target = end_steps(spec, savedir)
    return target is not None and logged_steps(run_dir(spec, savedir)) >= target


@dataclasses.dataclass
class RunResult:
    """How the last attempt at a run ended.

    status: "done" (logs reach the end: stop_at_steps, else total_steps), "skipped" (they
    already did), "failed" (a non-zero exit, or an exit before the end; `error` has the last
    lines of stderr),
    "stopped" (by Ctrl-C or SIGTERM; the next launch resumes it), "not run".
    """
    spec: RunSpec
    status: str
    returncode: int = None
    error: str = ""
    steps: float = math.nan  # the largest step in logs.csv
    target: int = None  # where the run ends (end_steps), when known
    elapsed_s: float = math.nan  # this attempt's wall time, launch to exit

    @property
    def short_error(self):
        """How it ended and the last line of stderr (usually the error itself), on one line."""
        lines = self.error.splitlines() or [""]
        return ": ".join(dict.fromkeys([lines[0], lines[-1]]))

    def to_json(self):
        record = dataclasses.asdict(self)
        record["xpid"] = self.spec.xpid
        return record


def write_json(path, record):
    """A JSON file, atomically: a reader (a report while the grid runs) never sees half of it.
    NaN is written as NaN, which Python's json reads back."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_launch_record(path, record):
    """launch.json (steps is NaN until the first row)."""
    write_json(os.path.join(path, "launch.json"), record)


def load_result(spec, savedir):
    """The RunResult of the last attempt, from launch.json and logs.csv, launching nothing."""
    path = run_dir(spec, savedir)
    result = RunResult(spec, "not run", steps=logged_steps(path),
                       target=end_steps(spec, savedir))
    try:
        with open(os.path.join(path, "launch.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    for key in ("status", "returncode", "error", "elapsed_s"):
        if record.get(key) is not None:
            setattr(result, key, record[key])
    if result.status == "running":  # its launcher died without a word (kill -9)
        result.status = "stopped"
    if result.target is not None and result.steps >= result.target:
        result.status = "done"  # whatever happened before, the logs reach the end
    return result


def stderr_tail(path, offset, lines=STDERR_TAIL_LINES):
    """The last non-empty lines written to the file at path after byte `offset`."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


# ---------------------------------------------------------------------------------------------
# Running the grid.

@dataclasses.dataclass
class Child:
    """A run in progress."""
    spec: RunSpec
    index: int  # 1-based, for the progress lines
    process: subprocess.Popen
    path: str
    stderr_offset: int  # where this attempt's stderr starts in stderr.txt
    started: float  # time.monotonic()
    files: tuple  # stdout.txt, stderr.txt, closed when it ends
    next_look: float = 0.0  # time.monotonic() of the next look at its logs (stop_at_steps)
    stopping: bool = False  # SIGTERM sent at stop_at_steps


def progress(message):
    print(f"[launch {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def start_run(spec, savedir, index):
    """Starts the run's subprocess; its output is appended to the run folder's files."""
    path = run_dir(spec, savedir)
    os.makedirs(path, exist_ok=True)
    command = spec.command(savedir)
    files = tuple(open(os.path.join(path, name), "ab") for name in ("stdout.txt", "stderr.txt"))
    banner = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode()
    for f in files:
        f.write(banner)
        f.flush()
    # Now, not after the start: the child shares the file offset, and may have written.
    stderr_offset = files[1].tell()
    try:
        # Its own session: a Ctrl-C on the terminal reaches only us, and we stop the
        # children with SIGTERM (they checkpoint), or kill a whole group that hangs.
        process = subprocess.Popen(command, cwd=REPO, stdout=files[0], stderr=files[1],
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        for f in files:
            f.close()
        raise
    write_launch_record(path, {"status": "running", "pid": process.pid, "command": command,
                               "xpid": spec.xpid, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    return Child(spec, index, process, path, stderr_offset, time.monotonic(), files)


def finish_run(child, savedir, stopped=False):
    """The RunResult of a child that has exited; written to its launch.json."""
    for f in child.files:
        f.close()
    code = child.process.returncode
    result = RunResult(child.spec, "done", returncode=code, steps=logged_steps(child.path),
                       target=end_steps(child.spec, savedir),
                       elapsed_s=time.monotonic() - child.started)
    tail = stderr_tail(os.path.join(child.path, "stderr.txt"), child.stderr_offset)
    reached = result.target is not None and result.steps >= result.target
    if reached and child.stopping:
        pass  # stopped at stop_at_steps: "done", whatever status the SIGTERM left
    elif stopped and not reached:
        result.status = "stopped"
    elif code != 0:
        result.status, result.error = "failed", f"exit status {code}\n{tail}".strip()
    elif not reached:
        # Exit 0 short of the end: stopped by someone else's signal; the next launch resumes.
        result.status = "failed"
        result.error = f"exited at step {result.steps:.0f} of {result.target}\n{tail}".strip()
    record = result.to_json()
    record["command"] = child.process.args
    write_launch_record(child.path, record)
    return result


def stop_children(children, timeout_s=STOP_TIMEOUT_S):
    """SIGTERM to every child (each checkpoints and exits), then SIGKILL to the process
    group of any still running after timeout_s in all; waits for each."""
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.process.pid, signal.SIGKILL)  # its actors and servers too
            except ProcessLookupError:
                pass
            child.process.wait()


def describe_start(spec, savedir):
    path = run_dir(spec, savedir)
    if os.path.exists(os.path.join(path, "model.tar")):
        return f"resume from its checkpoint (logs at step {logged_steps(path):.0f})"
    return "new"


def describe_end(result, index, total):
    name = f"{index}/{total} {result.spec.xpid}"
    if result.status in ("done", "stopped"):
        return f"{result.status} {name}: step {result.steps:.0f} in {result.elapsed_s:.1f} s"
    return f"FAILED {name}: {result.short_error}"


def _launch_next(spec, savedir, index, total, running, results):
    """Skips a finished run or starts it; a run that cannot even start is a failure."""
    if is_done(spec, savedir):
        target = end_steps(spec, savedir)
        results[index] = RunResult(spec, "skipped", steps=logged_steps(run_dir(spec, savedir)),
                                   target=target)
        progress(f"skip {index}/{total} {spec.xpid}: logs reach step {target}")
        return
    note = describe_start(spec, savedir)
    try:
        running.append(start_run(spec, savedir, index))
    except OSError as e:
        results[index] = RunResult(spec, "failed", error=f"cannot start: {e}")
        progress(f"FAILED {index}/{total} {spec.xpid}: cannot start: {e}")
        return
    progress(f"start {index}/{total} {spec.xpid} ({note})")


def stop_if_past(child, look_every_s=LOOK_EVERY_S):
    """SIGTERM to a child whose logs have passed its stop_at_steps (it checkpoints and exits);
    its logs.csv is read every look_every_s."""
    now = time.monotonic()
    if child.spec.stop_at_steps is None or child.stopping or now < child.next_look:
        return
    child.next_look = now + look_every_s
    if logged_steps(child.path) >= child.spec.stop_at_steps and child.process.poll() is None:
        child.process.send_signal(signal.SIGTERM)
        child.stopping = True


def run_grid(specs, savedir, parallel=1, poll_s=0.2, stop_timeout_s=STOP_TIMEOUT_S):
    """Runs every RunSpec, at most `parallel` at once; returns their RunResults in order.

    A failure is a result, not an exception. On KeyboardInterrupt (or any exception) every
    child is stopped (see stop_children) and recorded as "stopped" before it propagates.
    """
    savedir = os.path.abspath(os.path.expanduser(str(savedir)))
    os.makedirs(savedir, exist_ok=True)
    queue = [(i, share_cores(spec, parallel)) for i, spec in enumerate(specs, 1)]
    running, results = [], {}
    try:
        while queue or running:
            while queue and len(running) < parallel:
                index, spec = queue.pop(0)
                _launch_next(spec, savedir, index, len(specs), running, results)
            for child in running:
                stop_if_past(child)
            for child in [c for c in running if c.process.poll() is not None]:
                running.remove(child)
                results[child.index] = finish_run(child, savedir)
                progress(describe_end(results[child.index], child.index, len(specs)))
            if running:
                time.sleep(poll_s)
    finally:
        if running:
            progress(f"stopping {len(running)} run(s); the same command resumes them")
            stop_children(running, stop_timeout_s)
            for child in running:
                results[child.index] = finish_run(child, savedir, stopped=True)
                progress(describe_end(results[child.index], child.index, len(specs)))
    return [results[i] for i in sorted(results)]


# ---------------------------------------------------------------------------------------------
# The command line (bench.learn adds its own flags to the same grid flags).

def add_grid_flags(parser, envs, seeds, savedir, total_steps_default=None):
    """The flags that define a grid, with the defaults of the script that adds them;
    total_steps_default: what --total_steps's help says happens without it."""
    total_steps_default = total_steps_default or (
        "each variant's own for the env, from beast.flags.ENV_DEFAULTS: "
        + beast_flags.describe_defaults(beast_flags.ENV_DEFAULTS, "total_steps"))
    group = parser.add_argument_group("grid")
    group.add_argument("--envs", default=envs,
                       help="Comma-separated environment ids.")
    group.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                       help=f"Comma-separated trainers, of: {', '.join(VARIANTS)}.")
    group.add_argument("--seeds", default=seeds, help="Comma-separated seeds.")
    group.add_argument("--total_steps", type=int, default=None,
                       help=f"Steps for every run (default: {total_steps_default}).")
    group.add_argument("--stop_at_steps", type=int, default=None,
                       help="Stop each run (SIGTERM: it checkpoints) once its logs pass this "
                            "step, its learning-rate schedule still that of --total_steps, to "
                            "compare the first steps of long runs; a later launch with a "
                            "larger value resumes them (default: run to --total_steps).")
    group.add_argument("--savedir", default=savedir,
                       help="Where the runs go: savedir/<env>-<variant>-s<seed>/.")
    group.add_argument("--parallel", type=int, default=default_parallel(),
                       help=f"Runs at once (default: half the cores, at least 1: "
                            f"{default_parallel()} here); with more "
                            "than 1, each run gets cores/parallel learner threads unless "
                            "its flags set --num_torch_threads.")
    group.add_argument("--env_args", action="append", default=[], metavar="ENV=ARGS",
                       help="Extra flags for one env's runs, after the common ones "
                            "(repeatable), e.g. 'MinAtar/Breakout-v1=--num_actors 2'.")
    group.add_argument("--stop_timeout_s", type=float, default=STOP_TIMEOUT_S,
                       help="On Ctrl-C, seconds a run gets to checkpoint and exit before "
                            "it is killed.")
    return parser


def split_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def grid_problems(args):
    """Every problem with the grid flags, as a list of messages (empty: all fine)."""
    problems = []
    unknown = [v for v in split_list(args.variants) if v not in VARIANTS]
    if unknown or not split_list(args.variants):
        problems.append(f"--variants: {', '.join(unknown) or 'none given'}; "
                        f"expected some of {', '.join(VARIANTS)}.")
    try:
        seeds = [int(s) for s in split_list(args.seeds)]
        if not seeds:
            problems.append("--seeds: none given.")
    except ValueError:
        problems.append(f"--seeds must be comma-separated integers (got {args.seeds!r}).")
    if not split_list(args.envs):
        problems.append("--envs: none given.")
    if args.total_steps is not None and args.total_steps < 1:
        problems.append(f"--total_steps must be positive (got {args.total_steps}).")
    if args.stop_at_steps is not None and args.stop_at_steps < 1:
        problems.append(f"--stop_at_steps must be positive (got {args.stop_at_steps}).")
    elif None not in (args.stop_at_steps, args.total_steps) and (
            args.stop_at_steps > args.total_steps):
        problems.append(f"--stop_at_steps ({args.stop_at_steps}) is past --total_steps "
                        f"({args.total_steps}), where the runs end anyway.")
    if args.parallel < 1:
        problems.append(f"--parallel must be at least 1 (got {args.parallel}).")
    if getattr(args, "test_episodes", 0) < 0:  # bench.learn's
        problems.append(f"--test_episodes must not be negative (got {args.test_episodes}).")
    try:
        strays = sorted(set(parse_env_args(args.env_args)) - set(split_list(args.envs)))
        if strays:  # most likely a typo, which would otherwise be ignored silently
            problems.append(f"--env_args names envs not in --envs: {', '.join(strays)}.")
    except ValueError as e:
        problems.append(str(e))
    return problems


def split_argv(argv):
    """(our arguments, the variants') split at the first `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse_args(parser, argv):
    """Parses our flags and the variants' (after `--`); all problems end in one parser.error."""
    ours, extra = split_argv(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(ours)
    problems = grid_problems(args)
    if problems:
        parser.error("\n  - ".join(["the flags cannot work together:", *problems]))
    args.extra = extra
    args.savedir = os.path.abspath(os.path.expanduser(args.savedir))
    return args


@contextlib.contextmanager
def stop_on_signals():
    """Within it, SIGTERM and SIGINT end the launcher as Ctrl-C does: the children are stopped,
    not orphaned. SIGINT is set explicitly because a launcher started in the background of a
    script inherits it ignored, and a kill -INT would then leave it and its runs going. The
    previous handlers come back on exit (main may run inside a test)."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def make_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bench.launch",
        usage="python -m bench.launch [options] [-- flags for every run]",
        description="Run a grid of environments x variants x seeds on this machine, a few at "
                    "once; runs whose logs reach total_steps are skipped, stopped ones resume. "
                    "Everything after `--` is passed to every run.",
        formatter_class=beast_flags.HelpFormatter)
    return add_grid_flags(parser, envs="CartPole-v1", seeds="0", savedir="~/logs/beast-launch")


def grid_from_args(args, total_steps=None, env_args=None):
    """The RunSpecs of parsed grid flags; total_steps and env_args (dicts by env) are the
    caller's per-env table, which --total_steps and --env_args override or extend."""
    envs = split_list(args.envs)
    steps = args.total_steps if args.total_steps is not None else (total_steps or {})
    merged = {env: list((env_args or {}).get(env, ())) for env in envs}
    for env, extra in parse_env_args(args.env_args).items():
        merged[env].extend(extra)  # the command line's come last, so they win
    return make_grid(envs, split_list(args.variants), split_list(args.seeds), steps,
                     args.extra, merged, args.stop_at_steps)


def summary(results):
    """A markdown table of the results, one row per run."""
    lines = ["| run | status | steps | note |", "|---|---|---|---|"]
    for r in results:
        steps = "n/a" if math.isnan(r.steps) else f"{r.steps:,.0f}"
        if r.target is not None:
            steps += f" of {r.target:,}"
        note = r.short_error.replace("|", "\\|")
        lines.append(f"| {r.spec.xpid} | {r.status} | {steps} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(make_parser(), argv)
    try:
        with stop_on_signals():
            results = run_grid(grid_from_args(args), args.savedir, args.parallel,
                               stop_timeout_s=args.stop_timeout_s)
    except KeyboardInterrupt:
        progress("stopped; run the same command again to resume")
        return 130
    print(summary(results))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
