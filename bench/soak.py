"""A long run, watched: the memory, file descriptors and threads of each of its processes.

    python -m bench.soak --minutes 60 --kill_every_s 180 -- --env CartPole-v1
    python -m bench.soak --variant monobeast --minutes 60 -- --env MinAtar/Breakout-v1
    python -m bench.soak --report_only RUN_DIR       # the report again, from resources.csv

Starts `python -m <variant>` with the flags after `--` in a fresh run directory and its own
$TMPDIR, and every --sample_s writes one row per process of the run's tree to resources.csv
beside logs.csv: its role (learner, acting, polybeast_env, env_server, actor, ...), resident
memory, open file descriptors and threads. Every --kill_every_s it SIGKILLs one env server
(PolyBeast) or actor (MonoBeast), picked at random, which the run is to start again. After
--minutes it sends SIGTERM and waits, then looks for what the run left: processes of its
tree still alive, files in its $TMPDIR, shared-memory segments it mapped that still exist.

The report compares each role's figures (per process, averaged over the role's processes)
over the last samples with those at --baseline_min, writes resources.png beside them, and
exits with 1 when something was left behind. Measured, not asserted; one run at a time.
"""

import argparse
import csv
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from beast import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["time", "minute", "pid", "role", "rss_mb", "fds", "threads"]
FIGURES = ["rss_mb", "fds", "threads"]
KILLED_ROLE = {"polybeast": "env_server", "monobeast": "actor"}


def process_table():
    """{pid: (parent pid, start time in clock ticks, command line)} of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # The command name in parentheses may hold spaces; the fields after it do not.
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(name)] = (int(fields[1]), int(fields[19]), cmdline)
    return table


def tree(root, table):
    """The pids of `root` and all its descendants, each with its parent."""
    children = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found.append(pid)
            todo.extend(children.get(pid, []))
    return found


def role(pid, root, table, variant):
    """What a process of the run is, from its place in the tree and its command line."""
    if pid == root:
        return "learner"
    parent, _, cmdline = table[pid]
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    if "polybeast_env" in cmdline:
        return "polybeast_env"
    if parent in table and "polybeast_env" in table[parent][2]:
        return "env_server"
    if parent == root:
        return "acting" if variant == "polybeast" else "actor"
    return "other"


def figures(pid):
    """(resident MB, open file descriptors, threads) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = int(status.get("VmRSS", "0 kB").split()[0])
    return rss_kb / 1024, fds, int(status["Threads"])


def shared_memory_of(pid):
    """The /dev/shm files `pid` maps (their names, whether or not unlinked since)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}
    except (OSError, IndexError):
        return set()
    return {p.removesuffix(" (deleted)") for p in paths}


class Watch:
    """Samples a run's process tree and remembers every process and segment it saw."""

    def __init__(self, root, variant, path):
        self.root, self.variant, self.start = root, variant, time.time()
        self.seen = {}  # pid -> start time, to tell a leftover from a reused pid
        self.shared_memory = set()
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, FIELDS)
        self.writer.writeheader()

    def sample(self):
        table = process_table()
        now = time.time()
        for pid in tree(self.root, table):
            found = figures(pid)
            if found is None:
                continue
            self.seen[pid] = table[pid][1]
            self.shared_memory |= shared_memory_of(pid)
            rss_mb, fds, threads = found
            self.writer.writerow({"time": f"{now:.1f}", "minute": f"{(now - self.start) / 60:.2f}",
                                  "pid": pid, "role": role(pid, self.root, table, self.variant),
                                  "rss_mb": f"{rss_mb:.1f}", "fds": fds, "threads": threads})
        self.file.flush()
        return table

    def kill_one(self, table, rng):
        """SIGKILLs one process of the role the run restarts; returns its pid, or None."""
        wanted = KILLED_ROLE[self.variant]
        pids = [p for p in tree(self.root, table)
                if role(p, self.root, table, self.variant) == wanted]
        if not pids:
            return None
        pid = rng.choice(sorted(pids))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def leftovers(self, tmpdir):
        table = process_table()
        alive = [f"{pid} ({table[pid][2][:80]})" for pid, started in self.seen.items()
                 if pid in table and table[pid][1] == started]
        # torch keeps its compile cache (torchinductor_USER) in $TMPDIR for later processes.
        files = [os.path.relpath(os.path.join(d, n), tmpdir)
                 for d, dirs, names in os.walk(tmpdir) for n in dirs + names
                 if not n.startswith("torchinductor_") and "torchinductor_" not in d]
        segments = sorted(p for p in self.shared_memory if os.path.exists(p))
        return {"processes": alive, "files in $TMPDIR": files,
                f"shared memory (of {len(self.shared_memory)} /dev/shm files mapped)": segments}


def soak(args):
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    tmpdir = os.path.join(workdir, "tmp")
    os.makedirs(tmpdir, exist_ok=True)
    run_dir = os.path.join(workdir, "runs", "soak")
    os.makedirs(run_dir, exist_ok=True)
    command = [sys.executable, "-m", args.variant, "--savedir", os.path.join(workdir, "runs"),
               "--xpid", "soak", "--no_progress", "--total_steps", str(10**13),
               *args.run_flags]
    env = dict(os.environ, TMPDIR=tmpdir, PYTHONPATH=REPO)
    with open(os.path.join(workdir, "run.out"), "w") as out:
        run = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    watch = Watch(run.pid, args.variant, os.path.join(run_dir, "resources.csv"))
    rng = random.Random(args.seed)
    kills, next_kill = [], time.time() + (args.kill_every_s or float("inf"))
    end = time.time() + args.minutes * 60
    print(f"soak: {' '.join(command)} in {workdir}", flush=True)
    while time.time() < end and run.poll() is None:
        table = watch.sample()
        if time.time() >= next_kill:
            killed = watch.kill_one(table, rng)
            if killed:
                kills.append((time.time() - watch.start, killed))
            next_kill += args.kill_every_s
        time.sleep(max(0.0, min(args.sample_s, end - time.time())))
    still_running = run.poll() is None
    if still_running:
        watch.sample()
        run.send_signal(signal.SIGTERM)
    try:
        run.wait(args.stop_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    time.sleep(2)  # what the run's exit orphaned gets a moment to go
    left = watch.leftovers(tmpdir)
    watch.file.close()
    header = {"command": "python -m bench.soak " + " ".join(sys.argv[1:]),
              "run": " ".join(command[1:]),
              "machine": ", ".join(f"{k} {v}" for k, v in machine.describe().items()),
              "ran for": f"{(time.time() - watch.start) / 60:.1f} minutes, training until "
                         f"the end: {'yes' if still_running else 'no'}; exit code "
                         f"{run.returncode} on SIGTERM",
              "steps": f"{last_step(run_dir):,}",
              "killed": f"{len(kills)} {KILLED_ROLE[args.variant]} processes, every "
                        f"{args.kill_every_s:g} s" if kills else "nothing"}
    return run_dir, header, left


def last_step(run_dir):
    try:
        with open(os.path.join(run_dir, "logs.csv")) as f:
            return max((int(r["step"]) for r in csv.DictReader(f)), default=0)
    except OSError:
        return 0


def read_rows(run_dir):
    with open(os.path.join(run_dir, "resources.csv")) as f:
        return [dict(r, minute=float(r["minute"]), **{k: float(r[k]) for k in FIGURES})
                for r in csv.DictReader(f)]


def per_sample(rows):
    """{role: [(minute, {figure: mean over the role's processes})]}, in time order."""
    grouped = {}
    for r in rows:
        grouped.setdefault(r["role"], {}).setdefault(r["time"], []).append(r)
    series = {}
    for name, samples in grouped.items():
        series[name] = [(group[0]["minute"],
                         {k: sum(r[k] for r in group) / len(group) for k in FIGURES})
                        for _, group in sorted(samples.items(), key=lambda kv: float(kv[0]))]
    return series


def processes_per_sample(rows):
    """{role: "n" or "low-high"}: how many processes each role had in a sample."""
    counts = {}
    for r in rows:
        by_time = counts.setdefault(r["role"], {})
        by_time[r["time"]] = by_time.get(r["time"], 0) + 1
    spans = {name: (min(c.values()), max(c.values())) for name, c in counts.items()}
    return {name: f"{lo}" if lo == hi else f"{lo}-{hi}" for name, (lo, hi) in spans.items()}


def growth_table(series, counts, baseline_min, last):
    """Markdown rows: each role's figures at --baseline_min, at the end and at most after the
    baseline, and the end against the baseline."""
    lines = ["| role | processes per sample | figure | at baseline | at the end | "
             "highest after baseline | end / baseline |", "|---|---|---|---|---|---|---|"]
    for name, points in sorted(series.items()):
        base = [p for m, p in points if baseline_min <= m < baseline_min + 2]
        after = [p for m, p in points if m >= baseline_min]
        if not base or len(after) < last:
            continue
        for k in FIGURES:
            b = sum(p[k] for p in base) / len(base)
            e = sum(p[k] for p in after[-last:]) / last
            ratio = e / b if b else float("nan")
            lines.append(f"| {name} | {counts[name]} | {k} | {b:.1f} | {e:.1f} | "
                         f"{max(p[k] for p in after):.1f} | {ratio:.3f} |")
    return lines


def plot(series, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(5 * len(FIGURES), 4))
    for ax, k in zip(axes, FIGURES):
        for name, points in sorted(series.items()):
            ax.plot([m for m, _ in points], [p[k] for _, p in points], label=name)
        ax.set_xlabel("minute")
        ax.set_ylabel(f"{k} per process")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(run_dir, header, left, baseline_min, last):
    rows = read_rows(run_dir)
    series = per_sample(rows)
    counts = {}
    for r in rows:
        counts.setdefault(r["role"], set()).add(r["pid"])
    lines = ["# A long run, watched", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["- processes seen: " + ", ".join(f"{len(p)} {n}" for n, p in sorted(counts.items())),
              f"- samples: {len(series.get('learner', []))}; baseline at minute {baseline_min:g}, "
              f"end = the mean of the last {last}", ""]
    lines += growth_table(series, processes_per_sample(rows), baseline_min, last)
    lines += ["", "Left behind once the run ended:", ""]
    lines += [f"- {k}: {', '.join(v) if v else 'none'}" for k, v in left.items()]
    plot(series, os.path.join(run_dir, "resources.png"))
    lines += ["", "![resources per process](resources.png)"]
    return "\n".join(lines) + "\n"


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="polybeast", choices=sorted(KILLED_ROLE),
                        help="The entry script to run.")
    parser.add_argument("--minutes", type=float, default=60.0, help="How long the run trains.")
    parser.add_argument("--sample_s", type=float, default=60.0, help="Seconds between samples.")
    parser.add_argument("--kill_every_s", type=float, default=0.0,
                        help="SIGKILL one env server (PolyBeast) or actor (MonoBeast) this "
                             "often; 0 kills nothing.")
    parser.add_argument("--seed", type=int, default=0, help="Picks which process is killed.")
    parser.add_argument("--baseline_min", type=float, default=5.0,
                        help="The minute whose samples the end is compared with.")
    parser.add_argument("--last", type=int, default=3,
                        help="How many of the last samples make 'the end'.")
    parser.add_argument("--stop_timeout_s", type=float, default=120.0,
                        help="How long the run may take to stop on SIGTERM.")
    parser.add_argument("--workdir", default=None,
                        help="Where the run and its $TMPDIR go (a new temporary directory "
                             "by default).")
    parser.add_argument("--output", default=None, help="Also write the report here.")
    parser.add_argument("--report_only", default=None, metavar="RUN_DIR",
                        help="Only write the report of an earlier soak's run directory.")
    parser.add_argument("run_flags", nargs="*", help="The run's flags (after --).")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    if args.report_only:
        run_dir, header, left = args.report_only, {}, {}
    else:
        run_dir, header, left = soak(args)
    text = report(run_dir, header, left, args.baseline_min, args.last)
    print(text)
    for path in [os.path.join(run_dir, "SOAK.md")] + ([args.output] if args.output else []):
        with open(path, "w") as f:
            f.write(text)
    return 1 if any(left.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
