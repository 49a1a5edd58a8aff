"""Everything a run writes besides checkpoints: its directory, flags and metadata,
logs.csv, TensorBoard scalars, and the one-line status on the terminal.

Layout of a run directory (``savedir/xpid/``)::

    flags.json      the flags of the latest start (older starts: flags.json.1, .2, ...)
    meta.json       code version, package versions, host, start time, command line
    logs.csv        one row per logging point: _time, step, then the stats
    logs.after-checkpoint.csv
                    rows a start logged after its last checkpoint (it was killed before it
                    could write another), moved out of logs.csv by the resume, which logs
                    those steps again (older ones: .1, .2, ...)
    tensorboard/    the same scalars as TensorBoard events
    model.tar       the checkpoint (written by beast.checkpoint)
    videos/         MP4s of test and evaluation games (beast/video.py), when asked for
    wandb_id        the Weights & Biases run id, with --wandb_project: a resume continues it
    run.lock        locked while a training runs here (its pid, host and start time inside),
                    so that a second learner on the same --xpid stops with a message instead
                    of interleaving its logs and checkpoints with the first one's

With --wandb_project, StatsLogger sends W&B what it writes to logs.csv (and the videos);
W&B is imported only then. TrainingStats gathers a run's returns and losses into those rows;
RankLogger is what a learner rank other than 0 logs instead.
"""

import collections
import csv
import datetime
import errno
import fcntl
import importlib.metadata
import json
import math
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time


class RunDirError(ValueError):
    """The run directory cannot be created or written."""


class RunDir:
    """The directory ``savedir/xpid`` that holds everything a run writes.

    Args:
        savedir: parent directory of all runs; ``~`` is expanded.
        xpid: name of this run. None picks a fresh name "beast-YYYYmmdd-HHMMSS"
            (with a "-2", "-3", ... suffix if that directory already exists).
            An existing run directory is reused, which is how a run is resumed.
        create: make the directory now; with False only the paths are known
            until create() is called (so flags can be checked first).
    """

    def __init__(self, savedir, xpid=None, create=True):
        savedir = os.path.abspath(os.path.expanduser(str(savedir)))
        if xpid is None:
            xpid = time.strftime("beast-%Y%m%d-%H%M%S")
            base, n = xpid, 1
            # Two runs started in the same second must not share a directory.
            while os.path.exists(os.path.join(savedir, xpid)):
                n += 1
                xpid = f"{base}-{n}"
        self.xpid = xpid
        self.path = os.path.join(savedir, xpid)
        self._lock_file = None
        if create:
            self.create()

    def create(self):
        """Creates the directory and checks that it can be written."""
        try:
            os.makedirs(self.path, exist_ok=True)
            # makedirs succeeds on a read-only existing directory; only a write tells.
            probe = os.path.join(self.path, f".write_test.{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise RunDirError(
                f"cannot write the run directory {self.path}: "
                f"{e.strerror or e}. Pass a writable --savedir (or another --xpid)."
            ) from e

    def lock(self):
        """Claims the directory for this process's training until unlock() or exit.

        A POSIX record lock (fcntl.lockf): the kernel drops it when the process ends,
        however it ends, so a crashed run never leaves a stale lock behind, and forked
        actor processes do not inherit it. Raises RunDirError naming the holder when
        another process has it. A filesystem without locks gets a warning, not an error.
        """
        if self._lock_file is not None:
            return
        try:
            # "a+": opening must not erase the holder's line before we know we are not it.
            f = open(self.lock_path, "a+")
        except OSError as e:
            raise RunDirError(f"cannot write the run directory {self.path}: {e.strerror or e}. "
                              "Pass a writable --savedir (or another --xpid).") from e
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                print(f"warning: cannot lock {self.lock_path} ({e.strerror or e}); nothing "
                      "stops a second training from writing into this run directory.",
                      file=sys.stderr)
                return
            raise RunDirError(
                f"the run directory {self.path} is in use by another training "
                f"({holder or 'its process did not say which'}). Two learners in one directory "
                "would interleave their logs and overwrite each other's checkpoints: wait for "
                "that run to end (or stop it; it checkpoints and this command then resumes "
                "it), or pass another --xpid.") from None
        f.seek(0)
        f.truncate()
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
        f.flush()
        self._lock_file = f

    def unlock(self):
        """Releases the lock of lock(). The file stays: removing it would let a third
        process lock a new file while a second still holds the old, unlinked one."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def lock_path(self):
        return os.path.join(self.path, "run.lock")

    @property
    def flags_path(self):
        return os.path.join(self.path, "flags.json")

    @property
    def meta_path(self):
        return os.path.join(self.path, "meta.json")

    @property
    def logs_path(self):
        return os.path.join(self.path, "logs.csv")

    @property
    def checkpoint_path(self):
        return os.path.join(self.path, "model.tar")

    @property
    def tb_dir(self):
        return os.path.join(self.path, "tensorboard")

    @property
    def tests_path(self):
        return os.path.join(self.path, "tests.jsonl")

    @property
    def videos_dir(self):
        return os.path.join(self.path, "videos")

    @property
    def wandb_id_path(self):
        return os.path.join(self.path, "wandb_id")

    def __repr__(self):
        return f"RunDir({self.path!r})"


def record_test(path, step, policy, seed, returns):
    """Appends one line to tests.jsonl at path: a --mode test of the checkpoint of `step`,
    with the episodes' returns, so that its result outlives the terminal. One write of one
    line, so a test run beside a training (which never writes this file) cannot tear it."""
    record = {"time": time.time(), "step": int(step), "policy": policy, "seed": int(seed),
              "returns": [float(r) for r in returns]}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_tests(path):
    """The records of tests.jsonl at path, in the order written; [] without the file. A line
    that does not parse (a disk that filled mid-line) is left out."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("returns"), list):
            records.append(record)
    return records


def _keep_old(path):
    """Renames an existing file to path.1 (or .2, ...) so a resume never overwrites it."""
    if not os.path.exists(path):
        return
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")


def _git(args, cwd):
    try:
        result = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None  # no git installed, or it hung
    return result.stdout.strip() if result.returncode == 0 else None


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_json(path, obj):
    with open(path, "w") as f:
        # default=str: a flag of an unusual type is recorded rather than crashing the run.
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def write_metadata(run_dir, flags, extra=None):
    """Writes flags.json (vars(flags)) and meta.json (with `extra`'s items) into run_dir.

    On a resume the files of the earlier start are kept as flags.json.1,
    meta.json.1 (then .2, ...), so the history of a run is never lost.
    Returns the metadata dict.
    """
    code_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = _git(["rev-parse", "HEAD"], code_dir)
    # Tracked files only: a savedir or scratch files inside the checkout are not code changes.
    status = _git(["status", "--porcelain", "--untracked-files=no"], code_dir)
    now = datetime.datetime.now().astimezone()
    meta = {
        "git_commit": commit,  # None when the code is not in a git checkout
        "git_dirty": None if status is None else bool(status),
        "code_dir": code_dir,
        "versions": {
            "python": platform.python_version(),
            **{p: _version(p) for p in ("torch", "numpy", "gymnasium", "ale_py")},
        },
        "hostname": socket.gethostname(),
        "start_time": now.isoformat(timespec="seconds"),
        "start_unix": now.timestamp(),
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        **(extra or {}),
    }
    flags_dict = flags if isinstance(flags, dict) else vars(flags)
    for path, obj in ((run_dir.flags_path, flags_dict), (run_dir.meta_path, meta)):
        _keep_old(path)
        _write_json(path, obj)
    return meta


def _scalar(value):
    """A tensor or NumPy scalar as a Python number; anything else unchanged."""
    if hasattr(value, "item"):
        return value.item()
    return value


def _quiet_tensorboard_thread(args, _usual=threading.excepthook):
    """TensorBoard's event writer thread dies on a write error (a full disk) with a
    traceback; its writer raises the same error at the next call, which StatsLogger
    reports in one line. Other threads' errors go to the usual hook."""
    if (issubclass(args.exc_type, OSError)
            and type(args.thread).__module__.startswith("tensorboard.")):
        return
    _usual(args)


EVENT_FILE_PREFIX = "events.out.tfevents."


def wait_for_a_later_event_file_name(tb_dir):
    """Sleeps until the second of the clock is past the one in every event file's name in
    tb_dir. TensorBoard reads a run's event files in the order of their names, which start
    with the second they were created in and go on with the host, the pid and a counter
    that are not in the order of creation ("10" sorts before "9"): a resume's file made in
    the same second as the earlier start's could be read before it, and its purge of the
    earlier events past the checkpoint would then come too early to hide them."""
    try:
        names = os.listdir(tb_dir)
    except FileNotFoundError:
        return
    seconds = []
    for name in names:
        if name.startswith(EVENT_FILE_PREFIX):
            try:
                seconds.append(int(name[len(EVENT_FILE_PREFIX):].split(".")[0]))
            except ValueError:
                pass
    if seconds:
        time.sleep(max(0.0, max(seconds) + 1 - time.time()))


class StatsLogger:
    """Appends stats to logs.csv and to TensorBoard.

    logs.csv columns are ``_time`` (wall clock, seconds since the epoch), ``step``,
    then the stats keys, sorted. When a key appears that is not a column yet
    (e.g. the first evaluation result), the file is rewritten once with the
    wider header, atomically; earlier rows get an empty cell there. On a resume
    the existing file is appended to with its own header, so nothing is lost.
    A resume from a checkpoint of step S learns the steps after S again (S is 0 when the
    earlier start was killed before its first checkpoint): the rows that start logged past S
    are moved to logs.after-checkpoint.csv, and TensorBoard hides its events past S, so that
    each step has one row and one value.

    Args:
        run_dir: a RunDir.
        use_tensorboard: also write the numeric stats as TensorBoard scalars.
        flags: the run's flags; with flags.wandb_project, the rows (and videos) go to
            Weights & Biases too (WandbTracker).
        start_step: the step this start learns from: its checkpoint's, or 0 without one
            (rows an earlier start logged past it are set aside); None: set nothing aside.
    """

    def __init__(self, run_dir, use_tensorboard=True, flags=None, start_step=None):
        self.path = run_dir.logs_path
        self._wandb = None
        if flags is not None and flags.wandb_project:
            self._wandb = WandbTracker(run_dir, flags)
        if start_step is not None:
            try:
                set_aside_rows_after(self.path, int(start_step))
            except OSError as e:  # a full disk: a step twice in the file, but no row lost
                print(f"warning: cannot set aside the rows of {self.path} logged after step "
                      f"{start_step} ({e.strerror or e}); those steps appear twice.",
                      file=sys.stderr)
        self._fieldnames = None  # the columns of the rows logged so far
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as f:
                self._fieldnames = next(csv.reader(f))
        # The header logs.csv has now: a copy, since the first row of a resume may add columns
        # to _fieldnames in place, and the file must then be widened before it is appended to.
        self._on_disk = None if self._fieldnames is None else list(self._fieldnames)
        self._pending = []  # rows not written yet: the disk was full, or another error
        self._write_error = None
        self._tb = None
        if use_tensorboard:
            # Imported here: it is slow to import and plotting never needs it.
            from torch.utils.tensorboard import SummaryWriter

            # Events of the earlier start past the checkpoint are hidden from TensorBoard
            # (its readers drop those at and after purge_step when this writer starts).
            if start_step is not None:
                wait_for_a_later_event_file_name(run_dir.tb_dir)
            self._tb = SummaryWriter(
                log_dir=run_dir.tb_dir,
                purge_step=None if start_step is None else int(start_step) + 1)
            if threading.excepthook is threading.__excepthook__:  # not if others set one
                threading.excepthook = _quiet_tensorboard_thread

    def log(self, step, stats, videos=None):
        """Writes one row; stats maps names to numbers (or 0-d tensors, or strings).
        videos: {name: MP4 path}, for W&B (logs.csv and TensorBoard get the numbers alone).

        A row that cannot be written (a full disk, a quota) is kept and written with the
        next one that can be, so a disk that fills up for a while loses no row; TensorBoard
        stops for the rest of the run instead (its writer cannot recover)."""
        step = int(step)
        row = {k: _scalar(v) for k, v in stats.items() if k not in ("_time", "step")}
        row["_time"] = time.time()
        row["step"] = step
        if self._fieldnames is None:
            others = sorted(k for k in row if k not in ("_time", "step"))
            self._fieldnames = ["_time", "step", *others]
        else:
            self._fieldnames += sorted(k for k in row if k not in self._fieldnames)
        self._pending.append(row)
        self._write_pending()
        if self._tb is not None:
            self._write_tensorboard(step, row)
        if self._wandb is not None:
            self._wandb.log(step, row, videos)

    def _write_pending(self):
        try:
            self._append(self._pending)
        except OSError as e:
            if self._write_error is None:
                print(f"warning: cannot write {self.path} ({e.strerror or e}); its rows are "
                      "kept and written once it can be. Training goes on.", file=sys.stderr)
            self._write_error = e
            return
        if self._write_error is not None:
            print(f"{self.path} is written again ({len(self._pending)} rows had waited).",
                  file=sys.stderr)
            self._write_error = None
        self._pending = []

    def _append(self, rows):
        """Appends rows to logs.csv (with the header first, or a wider one); on an error
        the file is cut back to what it was, so no half row stays in it."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            self._on_disk = None
        elif self._on_disk != self._fieldnames:
            self._widen()
        size = os.path.getsize(self.path) if self._on_disk is not None else 0
        try:
            with open(self.path, "a", newline="") as f:
                if self._on_disk is None:
                    csv.writer(f).writerow(self._fieldnames)
                csv.DictWriter(f, self._fieldnames, restval="").writerows(rows)
        except OSError:
            try:
                os.truncate(self.path, size)  # frees space: it works on a full disk
            except OSError:
                pass
            raise
        self._on_disk = list(self._fieldnames)

    def _widen(self):
        """Rewrites logs.csv with the new columns appended to the header."""
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        width = len(self._fieldnames)  # earlier rows get an empty cell per new column
        _write_rows_atomically(self.path, self._fieldnames,
                               [row + [""] * (width - len(row)) for row in rows])
        self._on_disk = list(self._fieldnames)

    def _write_tensorboard(self, step, row):
        try:
            for key, value in row.items():
                if key == "_time" or isinstance(value, str) or value is None:
                    continue
                if not math.isnan(value):  # nan before the first episode ends
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        except OSError as e:
            # TensorBoard's writer thread died on the error, and every later call raises it.
            print(f"warning: TensorBoard events stop at step {step} ({e.strerror or e}); "
                  f"{self.path} keeps every row.", file=sys.stderr)
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError:
                pass

    def close(self):
        if self._pending:
            self._write_pending()
        if self._pending:
            steps = [row["step"] for row in self._pending]
            print(f"warning: the last {len(steps)} rows (steps {min(steps)} to {max(steps)}) "
                  f"could not be written to {self.path}.", file=sys.stderr)
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError:
                pass  # said when it failed
        if self._wandb is not None:
            wandb_run, self._wandb = self._wandb, None
            wandb_run.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def set_aside_rows_after(path, step):
    """Moves the rows of logs.csv at `path` whose step is past `step` to
    logs.after-checkpoint.csv beside it (an older such file becomes .1, .2, ...); returns
    how many moved. The moved rows are written (and synced) before logs.csv is replaced
    atomically, so a crash in between leaves a row twice, never nowhere."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except FileNotFoundError:
        return 0
    if not rows or "step" not in rows[0]:
        return 0
    header, column = rows[0], rows[0].index("step")

    def after(row):
        try:
            return float(row[column]) > step
        except (IndexError, ValueError):
            return False  # a row cut short by a crash stays where it is

    moved = [row for row in rows[1:] if after(row)]
    if not moved:
        return 0
    aside = os.path.join(os.path.dirname(path), "logs.after-checkpoint.csv")
    _keep_old(aside)
    _write_rows_atomically(aside, header, moved)
    _write_rows_atomically(path, header, [row for row in rows[1:] if not after(row)])
    print(f"Starting from step {step}: the {len(moved)} rows of {path} logged past it by an "
          f"earlier start are kept in {aside}.", file=sys.stderr)
    return len(moved)


def _write_rows_atomically(path, header, rows):
    """Writes a CSV file through a temporary file and a rename: a crash leaves the old file
    whole."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class TrackingError(RuntimeError):
    """Weights & Biases cannot track the run; the message says what to do."""


class WandbTracker:
    """The run's Weights & Biases run: the flags as its config, the rows of logs.csv, videos.

    Its id is kept in the run directory (RunDir.wandb_id_path) and W&B resumes it
    (resume="allow"), so a resumed run goes on in the same W&B run. Rows are plotted against
    the run's `step` (define_metric) rather than W&B's own counter, which must only grow:
    an evaluation row arrives after later training rows, and a resume repeats the steps
    logged after the last checkpoint.
    """

    def __init__(self, run_dir, flags):
        try:
            import wandb  # here: runs without --wandb_project never import it
        except ImportError:
            raise TrackingError("--wandb_project needs the Weights & Biases package: "
                                "pip install wandb") from None
        self._wandb = wandb
        # Our own id (W&B takes lowercase letters and digits), written before W&B starts.
        run_id = _read_or_create_id(run_dir.wandb_id_path, lambda: secrets.token_hex(4))
        kwargs = dict(project=flags.wandb_project, entity=flags.wandb_entity, id=run_id,
                      resume="allow", name=run_dir.xpid, mode=flags.wandb_mode)
        if "WANDB_DIR" not in os.environ:
            kwargs["dir"] = run_dir.path  # W&B's files in the run's folder, not the cwd
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:  # W&B raises its own types (no login, no network, ...)
            raise TrackingError(
                f"Weights & Biases did not start: {type(e).__name__}: {e}\nLog in with "
                "`wandb login`, or pass --wandb_mode offline (then `wandb sync` the run "
                "later).") from None
        # default=str: the config takes plain JSON, as flags.json does.
        config = {k: v for k, v in vars(flags).items() if k not in ("given", "typed")}
        config = json.loads(json.dumps(config, default=str))
        self.run.config.update(config, allow_val_change=True)  # a resume may change flags
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step, row, videos=None):
        """One row of logs.csv (numbers only, nan left out as in TensorBoard) and videos
        {name: MP4 path}, at the run's step."""
        data = {key: value for key, value in row.items()
                if key != "_time" and isinstance(value, (int, float)) and not math.isnan(value)}
        data["step"] = int(step)
        for name, path in (videos or {}).items():
            data[name] = self._wandb.Video(path, format="mp4")
        self.run.log(data)

    def close(self):
        self.run.finish()


def _read_or_create_id(path, new_id):
    """The id stored at `path`, or new_id() stored there first."""
    if os.path.exists(path):
        with open(path) as f:
            run_id = f.read().strip()
        if run_id:
            return run_id
    run_id = new_id()
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def start_times(path):
    """start_unix of each start of the run in path: meta.json, and meta.json.1, .2, ... that
    _keep_old keeps from earlier starts. Sorted; empty when there are none (hand-made logs)."""
    starts = []
    for name in os.listdir(path) if os.path.isdir(path) else ():
        if re.fullmatch(r"meta\.json(\.\d+)?", name):
            try:
                with open(os.path.join(path, name)) as f:
                    starts.append(float(json.load(f)["start_unix"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a damaged file costs only this start's launch time
    return sorted(starts)


def training_seconds(times, starts=()):
    """For each of `times` (sorted seconds since the epoch, one a logs.csv row), the seconds
    the run had trained by then: from its latest start to that time, plus, for each earlier
    start, from that start to its last row before the next one. The pause between a stop and
    its resume is left out. starts: start_times; without them, the first time stands for
    the only start (so the time to the first row is not counted).
    """
    if not times:
        return []
    starts = sorted(s for s in starts if s <= times[-1])
    if not starts or starts[0] > times[0]:  # rows from before the first start we know of
        starts = [times[0], *starts]
    seconds, before, start, last = [], 0.0, None, None
    for t in times:
        latest = max(s for s in starts if s <= t)
        if latest != start:
            if start is not None:
                before += last - start
            start = latest
        seconds.append(before + t - start)
        last = t
    return seconds


def read_logs(path):
    """Reads a logs.csv into a list of dicts, one per row.

    Numbers become floats, an empty cell (a column added later) becomes nan,
    anything else stays a string. Cells beyond the header (a row of a resume whose first
    row added a column, before StatsLogger widened the header then) have no name and are left
    out.
    """
    rows = []
    with open(path, newline="") as f:
        for record in csv.DictReader(f):
            row = {}
            record.pop(None, None)
            for key, value in record.items():
                if value is None or value == "":
                    row[key] = math.nan
                    continue
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = value
            rows.append(row)
    return rows


class EpisodeStats:
    """Returns and lengths of the last `window` finished episodes."""

    def __init__(self, window=100):
        self.returns = collections.deque(maxlen=window)
        self.lengths = collections.deque(maxlen=window)
        self.count = 0  # all episodes ever finished, not just the window

    def add(self, returns, lengths):
        """Records finished episodes; returns and lengths are sequences (lists, 1-d tensors)."""
        returns = [float(_scalar(r)) for r in returns]
        lengths = [int(_scalar(n)) for n in lengths]
        if len(returns) != len(lengths):
            raise ValueError(f"got {len(returns)} returns but {len(lengths)} lengths")
        self.returns.extend(returns)
        self.lengths.extend(lengths)
        self.count += len(returns)

    def mean_return(self):
        return sum(self.returns) / len(self.returns) if self.returns else math.nan

    def mean_length(self):
        return sum(self.lengths) / len(self.lengths) if self.lengths else math.nan

    def state_dict(self):
        """Plain lists and ints, so it can go into a checkpoint."""
        return {"returns": list(self.returns), "lengths": list(self.lengths), "count": self.count}

    def load_state_dict(self, state):
        self.returns.clear()
        self.lengths.clear()
        self.returns.extend(state["returns"])
        self.lengths.extend(state["lengths"])
        self.count = state["count"]


class StatusLine:
    """Progress on one line: a label (the precisions), step/total (percent), SPS, mean return
    and losses.

    On a terminal the line is redrawn in place (at most every `tty_interval`
    seconds). Elsewhere (CI logs, files) a plain line is printed at most every
    `interval` seconds, so a long run does not flood the log.

    SPS is measured between two printed lines. Of the stats given to update(),
    the line shows mean_episode_return and every key containing "loss".

    Args:
        total_steps: the step count at which the run ends.
        stream: where to write; default sys.stderr.
        interval: seconds between lines when stream is not a terminal.
        tty_interval: seconds between redraws on a terminal.
        clock: time source in seconds (replaceable in tests).
        label: the line's first part (None: none).
    """

    def __init__(self, total_steps, stream=None, interval=30.0, tty_interval=0.2,
                 clock=time.monotonic, label=None):
        self.total_steps = total_steps
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.is_tty = bool(isatty and isatty())
        self.interval = tty_interval if self.is_tty else interval
        self._clock = clock
        self._last_time = clock()
        self._last_step = None
        self._text = ""
        self._closed = False

    def _format(self, step, stats, sps):
        percent = 100.0 * step / self.total_steps if self.total_steps else 0.0
        parts = [f"step {step}/{self.total_steps} ({percent:.1f}%)", f"SPS {sps:.0f}"]
        if self.label:
            parts.insert(0, self.label)
        if "mean_episode_return" in stats:
            parts.append(f"return {_scalar(stats['mean_episode_return']):.2f}")
        for key, value in stats.items():
            if "loss" in key:
                parts.append(f"{key} {_scalar(value):.4g}")
        return " | ".join(parts)

    def update(self, step, stats=None):
        """Shows the new step, if the last line is old enough."""
        if self._closed:
            return
        now = self._clock()
        if self._last_step is None:
            self._last_step = step  # SPS needs a starting point
        if now - self._last_time < self.interval:
            return
        sps = (step - self._last_step) / (now - self._last_time)
        self._last_time, self._last_step = now, step
        self._text = self._format(step, stats or {}, sps)
        if self.is_tty:
            width = shutil.get_terminal_size().columns - 1
            # A line longer than the terminal wraps, and "\r" then only redraws its tail.
            self.stream.write("\r" + self._text[:width].ljust(width))
        else:
            self.stream.write(self._text + "\n")
        self.stream.flush()

    def close(self):
        """Ends the line; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.is_tty and self._text:
            self.stream.write("\n")
            self.stream.flush()


class TrainingStats:
    """Returns of the games that end in the training batches, the latest losses, and the
    rows of logs.csv (every --log_interval_steps); one lock, which also guards the logger."""

    def __init__(self, flags, logger, start_step, episode_state=None):
        self.flags = flags
        self.logger = logger
        self.lock = threading.Lock()
        self.episodes = EpisodeStats(window=100)
        if episode_state:
            self.episodes.load_state_dict(episode_state)
        self.latest = {}
        # The largest gradient norm since the last row: a row shows one update of the many
        # between rows, and an outlier that wrecks the policy is rarely the one shown.
        self.grad_norm_max = None
        self.env_errors = None  # the actors' environment restarts, when the variant counts them
        self.start_step, self.start_time = start_step, time.time()
        self.next_log_step = start_step + flags.log_interval_steps
        # learner_wait: the learner threads' seconds spent waiting for a batch since the last
        # row, against their seconds in all (threads x wall time since then).
        self.learner_threads, self.wait_s, self.window_start = 0, 0.0, None

    def timed(self, batches):
        """The batches of one learner thread, with its waits for them counted (learner_wait).
        The next batch is taken only when the loop asks for it."""
        self.learner_started()
        batches = iter(batches)
        while True:
            start = time.monotonic()
            pair = next(batches, None)
            if pair is None:
                return
            self.waited(time.monotonic() - start)
            yield pair

    def learner_started(self):
        """A learner thread that pulls batches from the actors starts (learner_wait)."""
        with self.lock:
            self.learner_threads += 1
            if self.window_start is None:
                self.window_start = time.monotonic()

    def waited(self, seconds):
        """A learner thread waited `seconds` for its next batch."""
        with self.lock:
            self.wait_s += seconds

    def _learner_wait(self):
        """The share of the learner threads' time since the last row spent waiting for
        batches; None when no thread pulls batches (serial and --deterministic runs)."""
        if not self.learner_threads:
            return None
        now = time.monotonic()
        share = self.wait_s / max(1e-9, self.learner_threads * (now - self.window_start))
        self.wait_s, self.window_start = 0.0, now
        return min(1.0, share)

    def record(self, step, stats, returns=(), lengths=()):
        """Adds one learner step's stats and the returns and lengths of the games that ended in
        its batch (learner.episode_stats); writes a row when one is due."""
        with self.lock:
            self.episodes.add(returns, lengths)
            stats["mean_episode_return"] = self.episodes.mean_return()
            stats["mean_episode_length"] = self.episodes.mean_length()
            stats["episodes"] = self.episodes.count
            stats["sps"] = (step - self.start_step) / max(1e-9, time.time() - self.start_time)
            if self.env_errors is not None:
                stats["env_errors"] = self.env_errors
            if math.isfinite(stats.get("grad_norm", math.nan)):
                self.grad_norm_max = max(self.grad_norm_max or 0.0, stats["grad_norm"])
            self.latest = stats
            if step >= self.next_log_step or step >= self.flags.total_steps:
                if self.grad_norm_max is not None:
                    stats["grad_norm_max"] = self.grad_norm_max
                    self.grad_norm_max = None
                learner_wait = self._learner_wait()
                if learner_wait is not None:
                    stats["learner_wait"] = learner_wait
                self.logger.log(step, stats)
                while self.next_log_step <= step:
                    self.next_log_step += self.flags.log_interval_steps

    def log(self, step, stats, videos=None):
        """Writes a row of other stats (evaluation results), with videos {name: MP4 path}."""
        with self.lock:
            if videos:
                self.logger.log(step, stats, videos=videos)
            else:
                self.logger.log(step, stats)


class RankLogger:
    """The logger of a learner rank other than 0: its own throughput and returns, on
    stderr; rank 0 writes the run's logs."""

    def __init__(self, ranks):
        self.ranks = ranks

    def log(self, step, stats):
        if "sps" not in stats:
            return
        print(f"{self.ranks.name(self.ranks.rank)}: step {step}, "
              f"{stats['sps'] / self.ranks.world_size:.0f} SPS on this rank, mean episode "
              f"return {stats.get('mean_episode_return', float('nan')):.2f}", file=sys.stderr)
