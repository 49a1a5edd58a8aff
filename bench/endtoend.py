"""End to end: `python -m monobeast|polybeast` as a user runs it, SPS read from logs.csv.

Each run gets a huge --total_steps; once its first logs.csv row appears (the
first learner step is done) it runs for `duration_s` more seconds, then gets
SIGTERM, upon which it checkpoints and exits. The first `warmup_fraction` of the
logged time span is dropped; what remains is cut into windows of consecutive
rows, and each window's SPS is (step difference) / (_time difference).
"""

import dataclasses
import importlib
import os
import signal
import statistics
import subprocess
import sys
import time

from beast import flags as beast_flags
from beast import runlog
from beast import training

from bench import ceilings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE_TOTAL_STEPS = 10**12


@dataclasses.dataclass
class Workload:
    """One end-to-end configuration: `python -m <variant> --env <env> <args>`."""
    key: str
    variant: str  # "monobeast" or "polybeast"
    env: str
    label: str
    args: list
    # Filled by resolve(): the flags the run will use, after the repo's defaults.
    flags: object = None
    net: object = None
    inference_batch: int = None


def resolve(workload):
    """Fills the flags the variant will use (defaults included) without starting it.

    Imports the variant's module (PolyBeast's needs libpolybeast), so a variant that
    cannot start fails here with an exception whose message says why.
    """
    module = importlib.import_module(workload.variant)
    flags = training.parse_flags(module.make_parser(), ["--env", workload.env, *workload.args])
    info = training.env_spec(flags)
    beast_flags.apply_env_defaults(flags, info.kind)
    problems = module.resolve_flags(flags, info)
    if problems:
        raise ValueError("; ".join(problems))
    workload.flags = flags
    workload.net = ceilings.NetSpec(flags.model, flags.hidden_size,
                                    tuple(info.observation_shape), info.num_actions,
                                    ",".join(map(str, flags.channels)), info.kind)
    if workload.variant == "monobeast":
        # One forward pass per actor serves its envs_per_actor environments.
        workload.inference_batch = (flags.envs_per_actor if flags.num_actors > 0
                                    else flags.batch_size)
    else:
        # The dynamic batcher serves at most inference_batch_size actors at once;
        # the real batch is whatever is waiting, so this is the optimistic size.
        workload.inference_batch = module.inference_batch_size(flags)
        # Each request carries the envs_per_stream environments of one stream.
        workload.inference_batch *= flags.envs_per_stream
    return workload


@dataclasses.dataclass
class RunResult:
    ok: bool
    reason: str = ""
    windows: list = dataclasses.field(default_factory=list)  # SPS of each window
    kept_sps: float = float("nan")  # steps / seconds over the whole kept span
    rows: int = 0
    startup_s: float = float("nan")  # launch -> first logs.csv row
    stop_s: float = float("nan")  # SIGTERM -> exit
    exit_code: int = None
    load1: float = float("nan")  # 1-minute load average when the run was stopped
    notes: list = dataclasses.field(default_factory=list)

    @property
    def median(self):
        return statistics.median(self.windows) if self.windows else float("nan")


def _log_rows(path):
    try:
        with open(path) as f:
            return max(0, sum(1 for _ in f) - 1)
    except FileNotFoundError:
        return 0


def _tail(path, chars=1500):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def sps_windows(rows, warmup_fraction, num_windows):
    """Window SPS values from logs.csv rows (dicts with _time and step).

    Drops the rows of the first warmup_fraction of the logged time span, then
    splits the remaining rows into up to num_windows runs of consecutive rows.
    Returns (list of window SPS, SPS over the whole kept span).
    """
    rows = sorted(rows, key=lambda r: r["_time"])
    if len(rows) < 2:
        return [], float("nan")
    t_first, t_last = rows[0]["_time"], rows[-1]["_time"]
    cut = t_first + warmup_fraction * (t_last - t_first)
    kept = [r for r in rows if r["_time"] >= cut]
    if len(kept) < 2:
        kept = rows[-2:]
    intervals = len(kept) - 1
    count = min(num_windows, intervals)
    bounds = [round(i * intervals / count) for i in range(count + 1)]
    windows = []
    for a, b in zip(bounds, bounds[1:]):
        dt = kept[b]["_time"] - kept[a]["_time"]
        if dt > 0:
            windows.append((kept[b]["step"] - kept[a]["step"]) / dt)
    span = kept[-1]["_time"] - kept[0]["_time"]
    kept_sps = (kept[-1]["step"] - kept[0]["step"]) / span if span > 0 else float("nan")
    return windows, kept_sps


def run_training(workload, log_interval_steps, duration_s, workdir, warmup_fraction=0.2,
                 num_windows=8, startup_timeout_s=180.0, stop_timeout_s=90.0,
                 while_running=None, log=print, command_prefix=()):
    """Runs one workload in a subprocess for duration_s after its first log row.

    while_running: optional fn(pid) called once the first row is there (py-spy
    attaches there); its time counts towards duration_s.
    command_prefix: words before the command, one that execs it (the pid stays the run's),
    e.g. ("ip", "netns", "exec", NAME) to run it inside a network namespace.
    Returns a RunResult.
    """
    xpid = workload.key
    command = [*command_prefix, *training_command(workload, log_interval_steps, workdir)]
    out_path = os.path.join(workdir, f"{xpid}.out")
    logs_path = os.path.join(workdir, xpid, "logs.csv")
    result = RunResult(ok=False)
    log(f"end to end: {workload.variant} {workload.env} {' '.join(workload.args)} "
        f"(log every {log_interval_steps} steps, {duration_s:g} s after the first row)")
    with open(out_path, "w") as out:
        launch = time.monotonic()
        # Its own session: if it does not stop on SIGTERM we can kill it and its actors.
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            first_row = _wait_for_first_row(process, result, launch, logs_path, out_path,
                                            startup_timeout_s)
            if first_row is None:
                return result
            if while_running is not None:
                while_running(process.pid)
            if not _train_until(process, result, first_row + duration_s, out_path):
                return result
            _stop(process, result, stop_timeout_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return _time_windows(result, logs_path, warmup_fraction, num_windows)


def training_command(workload, log_interval_steps, workdir):
    """The command line of the run: checkpoints only at the end, never done on its own."""
    return [sys.executable, "-m", workload.variant, "--env", workload.env, *workload.args,
            "--savedir", workdir, "--xpid", workload.key, "--no_progress",
            "--total_steps", str(HUGE_TOTAL_STEPS),
            "--log_interval_steps", str(log_interval_steps),
            "--checkpoint_interval_s", "1e9"]


def _exited(process, result, out_path, when):
    """Whether the run has exited; if so, result.reason says so with its output's tail."""
    code = process.poll()
    if code is None:
        return False
    result.reason = f"exited with status {code} {when}; output tail:\n" + _tail(out_path)
    return True


def _wait_for_first_row(process, result, launch, logs_path, out_path, startup_timeout_s):
    """Polls until logs.csv has a row, i.e. the first learner step is done.

    Returns the time of that poll (time.monotonic()), or None with result.reason
    set if the run exits or startup_timeout_s passes first.
    """
    while True:
        if _exited(process, result, out_path, "before its first log row"):
            return None
        now = time.monotonic()
        if _log_rows(logs_path) >= 1:
            result.startup_s = now - launch
            return now
        if now - launch > startup_timeout_s:
            result.reason = (f"no log row within {startup_timeout_s:g} s; output tail:\n"
                             + _tail(out_path))
            return None
        time.sleep(0.25)


def _train_until(process, result, deadline, out_path):
    """Lets the run train until `deadline` (time.monotonic()); False, with
    result.reason set, if it exits before."""
    while True:
        time.sleep(0.25)
        if _exited(process, result, out_path, "during the run"):
            return False
        if time.monotonic() >= deadline:
            return True


def _stop(process, result, stop_timeout_s):
    """SIGTERM, upon which the run checkpoints and exits; records how that went.

    A run still there after stop_timeout_s is left to the caller to kill.
    """
    result.load1 = load_average()
    stop = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        result.exit_code = process.wait(stop_timeout_s)
    except subprocess.TimeoutExpired:
        result.notes.append(f"did not exit within {stop_timeout_s:g} s of SIGTERM; killed")
    result.stop_s = time.monotonic() - stop
    if result.exit_code not in (0, None):
        result.notes.append(f"exit status {result.exit_code} after SIGTERM")


def _time_windows(result, logs_path, warmup_fraction, num_windows):
    """Fills result's windows from the finished run's logs.csv; ok if there is one."""
    rows = runlog.read_logs(logs_path)
    result.rows = len(rows)
    result.windows, result.kept_sps = sps_windows(rows, warmup_fraction, num_windows)
    if not result.windows:
        result.reason = f"only {len(rows)} log row(s): too few to time a window"
        return result
    if len(result.windows) < 3:
        result.notes.append(f"only {len(result.windows)} window(s)")
    result.ok = True
    return result
