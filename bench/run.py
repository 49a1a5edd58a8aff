"""python -m bench: throughput of MonoBeast and PolyBeast on this machine, as a markdown report.

Sections (run one after another, never in parallel, in this order):
  env        raw environment stepping (Pong with our preprocessing, CartPole, Null)
  learner    beast.learner.learn_step alone on a random rollout (Atari fp32/bf16, MLPs)
  inference  the acting forward pass alone (Atari net at batch 1, 8, 32, ...)
  bound      the compute bound on end-to-end SPS of each configuration, from the ceilings
  e2e        python -m monobeast / polybeast in a subprocess, SPS from logs.csv
  profile    where a null-env step's time goes (MonoBeast in-process; PolyBeast with py-spy)

See bench/README.md for what each number means.
"""

import argparse
import importlib.util
import datetime
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python -m bench` from another directory
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from beast import flags as beast_flags  # noqa: E402
from beast import machine  # noqa: E402

from bench import ceilings  # noqa: E402
from bench import endtoend  # noqa: E402
from bench import null_env  # noqa: E402
from bench import nullprofile  # noqa: E402

SECTIONS = ("env", "learner", "inference", "bound", "e2e", "profile")
# Pong as the Atari kind runs it (no sticky actions: the Atari net's defaults), and with the
# sticky actions of its v5 id, which take the defaults of their own kind.
PONG = "PongNoFrameskip-v4"
STICKY_PONG = "ALE/Pong-v5"
ENV_IDS = (PONG, STICKY_PONG, "CartPole-v1", null_env.ENV_ID)
# NetHack's stepping when nle is installed (its own optional dependency).
if importlib.util.find_spec("nle") is not None:
    ENV_IDS += ("NetHackScore-v0",)
NULL_MODEL_ARGS = ["--model", "mlp", "--hidden_size", "8"]


def workloads():
    """The end-to-end configurations, in the order they run."""
    return _pong_workloads() + _other_workloads()


CLEANBA_BATCH = ["--batch_size", "32", "--learning_rate", "0.0006", "--envs_per_actor", "16"]


def _pong_workloads():
    W = endtoend.Workload
    tb_atari = ["--batch_size", "8", "--unroll_length", "80"]
    return [
        W("mono-pong-tb", "monobeast", PONG,
          "TorchBeast's",
          ["--num_actors", "4", "--envs_per_actor", "1", *tb_atari]),
        W("mono-pong-default", "monobeast", PONG, "repo defaults", []),
        W("mono-pong-deterministic", "monobeast", PONG, "repo defaults, --deterministic",
          ["--deterministic"]),
        # The defaults' precision is auto (bf16 on a CPU with bf16 instructions); these
        # pin it, so that a report shows what each side gains on any machine.
        W("mono-pong-fp32", "monobeast", PONG, "repo defaults, fp32 everywhere",
          ["--precision", "fp32", "--acting_precision", "fp32"]),
        W("mono-pong-bf16", "monobeast", PONG, "repo defaults, bf16 learner only",
          ["--precision", "bf16", "--acting_precision", "fp32"]),
        W("mono-pong-all-bf16", "monobeast", PONG, "repo defaults, bf16 everywhere",
          ["--precision", "bf16", "--acting_precision", "bf16"]),
        W("mono-pong-envpool", "monobeast", PONG, "repo defaults, EnvPool",
          ["--env_backend", "envpool"]),
        # What the settings that might learn more per step cost per second: the IMPALA
        # ResNet, Adam, and twice the games in flight.
        W("mono-pong-resnet", "monobeast", PONG, "repo defaults, --model resnet",
          ["--model", "resnet"]),
        # Cleanba's updates (B=32 at 6e-4, 16 games an actor) with each network: the per-step
        # comparisons of docs/results.md ran at this batch.
        W("mono-pong-b32", "monobeast", PONG, "Cleanba's batch, the Atari net",
          CLEANBA_BATCH),
        W("mono-pong-resnet-b32", "monobeast", PONG, "Cleanba's batch, the ResNet",
          ["--model", "resnet", *CLEANBA_BATCH]),
        W("mono-pong-resnet8-b32", "monobeast", PONG,
          "Cleanba's batch, the ResNet at 8,16,16",
          ["--model", "resnet", "--channels", "8,16,16", *CLEANBA_BATCH]),
        W("mono-pong-adam", "monobeast", PONG, "repo defaults, --optimizer adam",
          ["--optimizer", "adam"]),
        W("mono-pong-ep16", "monobeast", PONG, "repo defaults, 16 games an actor",
          ["--envs_per_actor", "16"]),
        # With sticky actions Pong takes the defaults of its own kind (the narrow ResNet).
        W("mono-pong-sticky-default", "monobeast", STICKY_PONG, "repo defaults (narrow ResNet)",
          []),
        W("poly-pong-tb", "polybeast", PONG, "TorchBeast's",
          ["--num_actors", "4", "--envs_per_stream", "1", *tb_atari]),
        W("poly-pong-default", "polybeast", PONG, "repo defaults", []),
        W("poly-pong-fp32", "polybeast", PONG, "repo defaults, fp32 everywhere",
          ["--precision", "fp32", "--acting_precision", "fp32"]),
        W("poly-pong-all-bf16", "polybeast", PONG, "repo defaults, bf16 everywhere",
          ["--precision", "bf16", "--acting_precision", "bf16"]),
        W("poly-pong-sticky-default", "polybeast", STICKY_PONG, "repo defaults (narrow ResNet)",
          []),
    ]


def _other_workloads():
    W = endtoend.Workload
    return [
        W("mono-cartpole", "monobeast", "CartPole-v1", "repo defaults", []),
        W("mono-cartpole-deterministic", "monobeast", "CartPole-v1",
          "repo defaults, --deterministic", ["--deterministic"]),
        W("poly-cartpole", "polybeast", "CartPole-v1", "repo defaults", []),
        # MinAtar's 10x10 frames: the ResNet (the default for small images) beside the
        # MinAtar paper's one-conv net, which does a fraction of its work per frame.
        W("mono-minatar", "monobeast", "MinAtar/Breakout-v1", "repo defaults (ResNet)", []),
        W("mono-minatar-acting-bf16", "monobeast", "MinAtar/Breakout-v1",
          "repo defaults (ResNet), bf16 actors", ["--acting_precision", "bf16"]),
        W("mono-minatar-small", "monobeast", "MinAtar/Breakout-v1", "--model small",
          ["--model", "small"]),
        W("poly-minatar", "polybeast", "MinAtar/Breakout-v1", "repo defaults (ResNet)", []),
        W("poly-minatar-acting-bf16", "polybeast", "MinAtar/Breakout-v1",
          "repo defaults (ResNet), bf16 inference", ["--acting_precision", "bf16"]),
        W("poly-minatar-small", "polybeast", "MinAtar/Breakout-v1", "--model small",
          ["--model", "small"]),
        # NetHack (nle): Dict observations, long episodes, NetHackNet.
        W("mono-nethack", "monobeast", "NetHackScore-v0", "repo defaults (NetHackNet)", []),
        W("poly-nethack", "polybeast", "NetHackScore-v0", "repo defaults (NetHackNet)", []),
        # One environment per actor / stream, as TorchBeast does, beside the defaults: what
        # stepping several environments per forward pass saves in overhead per step.
        W("mono-null-1env", "monobeast", null_env.ENV_ID, "MLP 8, one env per actor",
          ["--num_actors", "4", "--envs_per_actor", "1", *NULL_MODEL_ARGS]),
        W("mono-null", "monobeast", null_env.ENV_ID, "MLP 8", NULL_MODEL_ARGS),
        W("poly-null-1env", "polybeast", null_env.ENV_ID, "MLP 8, one env per stream",
          ["--num_actors", "4", "--envs_per_stream", "1", *NULL_MODEL_ARGS]),
        W("poly-null", "polybeast", null_env.ENV_ID, "MLP 8", NULL_MODEL_ARGS),
    ]


def make_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Throughput benchmark of MonoBeast and PolyBeast: ceilings of each piece, "
                    "the compute bound they imply, end-to-end SPS and a null-env profile. "
                    "Prints a markdown report. Measurements, not tests: nothing is asserted.",
        formatter_class=beast_flags.HelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="Short measurements (about 4 minutes in all instead of about 12).")
    parser.add_argument("--only", default=None,
                        help=f"Comma-separated sections to run, from: {', '.join(SECTIONS)} "
                             "(default: all). The bound measures the ceilings it needs; e2e "
                             "implies bound.")
    parser.add_argument("--workloads", default=None,
                        help="Comma-separated end-to-end workloads to run, from: "
                             f"{', '.join(w.key for w in workloads())} (default: all).")
    parser.add_argument("--output", default=None,
                        help="Also write the markdown report to this file.")
    parser.add_argument("--duration", type=float, default=None,
                        help="Seconds each end-to-end run trains after its first log row "
                             "(default: 60, or 15 with --quick).")
    parser.add_argument("--warmup_fraction", type=float, default=0.2,
                        help="Fraction of each run's logged time span dropped as warm-up.")
    parser.add_argument("--windows", type=int, default=None,
                        help="Timed windows per end-to-end run (default: 8, or 5 with --quick).")
    parser.add_argument("--rows_per_second", type=float, default=20.0,
                        help="Aim for at most this many logs.csv rows per second at the compute "
                             "bound (--log_interval_steps is a multiple of T*B chosen from it).")
    parser.add_argument("--workdir", default=None,
                        help="Where the end-to-end runs write (default: a temporary directory, "
                             "removed at the end).")
    parser.add_argument("--keep_runs", action="store_true",
                        help="Keep the run directories of the end-to-end runs.")
    return parser


def log(message):
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Formatting.

def table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def fmt(x, digits=3):
    """A number with `digits` significant digits, no exponent for ordinary sizes."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{x:,.{decimals}f}"


def machine_header(args, cores):
    def version(package):
        try:
            import importlib.metadata
            return importlib.metadata.version(package)
        except Exception:
            return "n/a"

    cpu, bf16 = machine.this_cpu()
    gpu = machine.gpu_description("cuda") if torch.cuda.is_available() else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or "n/a"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return [
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
        f"host {socket.gethostname()}, commit {commit}{' (modified)' if dirty else ''}",
        f"- CPU: {cpu}; cores available to us (sched_getaffinity): {cores} "
        f"of {os.cpu_count()}",
        f"- bf16 in hardware: {bf16} (--precision bf16 gains much more with AMX)",
        f"- GPU: {gpu or 'none (the learners run on the CPU)'}",
        f"- torch {torch.__version__} (intra-op threads by default: {torch.get_num_threads()}), "
        f"python {platform.python_version()}, numpy {version('numpy')}, gymnasium "
        f"{version('gymnasium')}, ale-py {version('ale-py')}",
        f"- load at start (uptime): {uptime()}",
        f"- mode: {'quick' if args.quick else 'full'}; end-to-end runs: {args.duration:g} s after "
        f"the first log row, first {args.warmup_fraction:.0%} of the logged span dropped, "
        f"{args.windows} windows",
    ]


def uptime():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        try:
            with open("/proc/loadavg") as f:
                return "load average " + f.read().strip()
        except OSError:
            return "n/a"


# ---------------------------------------------------------------------------------------------
# Sections.

class Report:
    def __init__(self):
        self.parts = []
        self.notes = []

    def section(self, title, text, intro=None):
        block = [f"## {title}", ""]
        if intro:
            block += [intro, ""]
        block.append(text)
        self.parts.append("\n".join(block))

    def note(self, message):
        log("note: " + message)
        self.notes.append(message)


def envpool_cases(cores):
    """(label, num_envs, batch_size, threads): the actors' synchronous use, and EnvPool's
    asynchronous best case on all cores."""
    return [("sync, 1 thread (as an actor uses it)", 8, 8, 1),
            (f"async, {cores} threads", 4 * cores, 2 * cores, cores)]


def section_env(report, ceil, cores):
    rows = []
    for env_id in ENV_IDS:
        r = ceil.env(env_id)
        rows.append([env_id, f"gymnasium, {ceilings.VECTOR_ENVS} envs", fmt(r["median"]),
                     f"{fmt(r['min'])} - {fmt(r['max'])}", fmt(r["core_us"])])
    for label, num_envs, batch, threads in envpool_cases(cores):
        r = ceil.envpool(PONG, num_envs, batch, threads)
        if r is None:
            report.note("EnvPool is not installed (pip install envpool): its rows are missing.")
            break
        rows.append([PONG, f"EnvPool {label}: {num_envs} envs, batch {batch}",
                     fmt(r["median"]), f"{fmt(r['min'])} - {fmt(r['max'])}",
                     fmt(r["core_us"])])
    report.section(
        "1a. Environment stepping alone",
        table(["env", "how", "steps/s", "range over chunks", "core-us/step"], rows),
        "Random actions. gymnasium: one process steps a vector env of "
        f"{ceilings.VECTOR_ENVS} (`beast.vector_envs`, as an actor or a server stream does; "
        "each env a `RolloutAdapter(create_env(flags))`; Pong: our DeepMind-style "
        "preprocessing, without sticky actions and with them). EnvPool: "
        "`envpool.make` with the same preprocessing, send/recv (asynchronous when the batch "
        "is smaller than the pool). core-us/step: CPU time of the process, all its threads, "
        "per step.")


LEARNER_CASES = [
    (ceilings.ATARI_NET, "fp32"), (ceilings.ATARI_NET, "bf16"),
    (ceilings.CARTPOLE_NET, "fp32"), (ceilings.NULL_NET, "fp32"),
]


def section_learner(report, ceil, cores):
    rows = []
    for net, precision in LEARNER_CASES:
        for threads in sorted({1, cores}):
            r = ceil.learner(net, precision, threads)
            steps = r["unroll_length"] * r["batch_size"]
            rows.append([ceilings.net_label(net), f"{r['unroll_length'] + 1} x {r['batch_size']}",
                         precision, threads, fmt(r["median"] * 1e3),
                         f"{fmt(r['min'] * 1e3)} - {fmt(r['max'] * 1e3)}",
                         fmt(steps / r["median"]), fmt(r["median"] * 1e6 / steps)])
    report.section(
        "1b. Learner step alone",
        table(["model", "T+1 x B", "precision", "threads", "ms/step", "range", "env steps/s equiv",
               "us per env step"], rows),
        "`beast.learner.learn_step` (forward over the rollout, V-trace, backward, gradient "
        "clipping, RMSprop) on a random rollout, with the repo's T and B for that input; "
        "one learner step consumes T*B env steps. bf16 is `--precision bf16` (autocast).")


def section_inference(report, ceil, needed):
    sizes = {ceilings.ATARI_NET: {1, 8, 32}}
    for net, batch in needed:
        sizes.setdefault(net, set()).add(batch)
    rows = []
    for net, batch_sizes in sizes.items():
        for batch in sorted(batch_sizes):
            r = ceil.inference(net, batch)
            rows.append([ceilings.net_label(net), batch, fmt(r["median"] * 1e3),
                         f"{fmt(r['min'] * 1e3)} - {fmt(r['max'] * 1e3)}",
                         fmt(r["median"] * 1e6 / batch), fmt(batch / r["median"])])
    report.section(
        "1c. Inference alone",
        table(["model", "batch", "ms/call", "range", "us per env step", "env steps/s equiv"],
              rows),
        "The acting forward pass (`torch.no_grad`, T=1, training mode so actions are sampled, "
        "outputs to NumPy) with one intra-op thread, as an actor runs it. Batch sizes beyond "
        "1, 8, 32 are those the end-to-end configurations use.")


def config_of(workload):
    """'<label>: 2 actors x 4 envs, B=8, T=80' from the flags the run uses."""
    f = workload.flags
    if workload.variant == "monobeast":
        shape = f"{f.num_actors} actors x {f.envs_per_actor} envs"
    else:
        shape = f"{f.num_actors} servers x {f.envs_per_stream} envs"
    return f"{workload.label}: {shape}, B={f.batch_size}, T={f.unroll_length}"


def bound_of(ceil, workload, cores):
    """Core-seconds per env step of each part and the bound (dict).

    Each part's cost is its fastest measurement: on a shared machine other work
    only ever adds time, so the fastest run is the best estimate of the work
    itself, and the bound stays a bound when the load drops during the e2e runs.
    """
    flags = workload.flags
    if flags.env_backend == "envpool":
        label, num_envs, batch, threads = envpool_cases(cores)[0]
        env_s = ceil.envpool(workload.env, num_envs, batch, threads)["core_us"] / 1e6
    else:
        env_s = 1.0 / ceil.env(workload.env)["max"]
    inference_s = ceil.inference(workload.net, workload.inference_batch)["min"] \
        / workload.inference_batch
    learner_r = ceil.learner(workload.net, flags.precision, 1,
                             flags.unroll_length, flags.batch_size)
    learner_s = learner_r["min"] / (flags.unroll_length * flags.batch_size)
    cost = env_s + inference_s + learner_s
    return dict(env=env_s, inference=inference_s, learner=learner_s, cost=cost, sps=cores / cost)


def section_bound(report, ceil, resolved, cores):
    rows = []
    bounds = {}
    for w in resolved:
        b = bounds[w.key] = bound_of(ceil, w, cores)
        rows.append([w.variant, w.env, config_of(w),
                     fmt(b["env"] * 1e6),
                     f"{fmt(b['inference'] * 1e6)} (batch {w.inference_batch})",
                     fmt(b["learner"] * 1e6), fmt(b["cost"] * 1e6), fmt(b["sps"])])
    report.section(
        "2. Compute bound",
        table(["variant", "env", "config", "env us", "inference us", "learner us",
               "core-us per step", f"bound SPS ({cores} cores)"], rows),
        "Cost of one env step in core-microseconds: env step (1 / raw SPS) + inference "
        "(one-thread forward at the configuration's batch, divided by the batch) + learner "
        "(one-thread step at the run's precision / (T*B)), each from the fastest of its "
        "measurements above (the best estimate of the work itself on a shared machine; the "
        "tables above show "
        "medians; EnvPool's env cost is its core-us/step, synchronous, one thread). "
        "Bound = cores / cost: the SPS if every core did "
        "nothing but this work. PolyBeast's inference batch is the largest its dynamic "
        "batcher forms (--inference_batch_size = --num_actors streams of --envs_per_stream "
        "environments each), so its bound is optimistic.")
    return bounds


def log_interval_for(workload, bound, rows_per_second):
    """A multiple of T*B so that rows come at most rows_per_second at the bound."""
    steps = workload.flags.unroll_length * workload.flags.batch_size
    sps = bound["sps"] if bound else {PONG: 1000, STICKY_PONG: 500, "CartPole-v1": 8000}.get(
        workload.env, 16000)
    return steps * max(1, int(sps / rows_per_second / steps))


def section_e2e(report, args, resolved, bounds, cores, workdir):
    rows = []
    results = {}
    for w in resolved:
        if isinstance(w, tuple):  # (workload, reason): could not even resolve its flags
            workload, reason = w
            rows.append([workload.variant, workload.env, workload.label, "skipped", "", "", "",
                         "", "", "", ""])
            report.note(f"{workload.variant} {workload.env}: skipped: {reason}")
            continue
        bound = bounds.get(w.key)
        interval = log_interval_for(w, bound, args.rows_per_second)
        try:
            r = endtoend.run_training(w, interval, args.duration, workdir,
                                      warmup_fraction=args.warmup_fraction,
                                      num_windows=args.windows, log=log)
        except Exception as e:  # one failed run must not cost the others
            traceback.print_exc()
            r = endtoend.RunResult(ok=False, reason=f"{type(e).__name__}: {e}")
        results[w.key] = r
        config = config_of(w)
        if not r.ok:
            rows.append([w.variant, w.env, config, "failed", "", "", "", "", "", "", ""])
            report.note(f"{w.variant} {w.env} ({w.key}) failed: {r.reason}")
            continue
        fraction = r.median / bound["sps"] if bound else float("nan")
        rows.append([
            w.variant, w.env, config, fmt(r.median),
            f"{fmt(min(r.windows))} - {fmt(max(r.windows))} ({len(r.windows)})",
            fmt(bound["sps"]) if bound else "n/a", f"{fraction:.0%}" if bound else "n/a",
            fmt(1e6 / r.median), fmt(cores * 1e6 / r.median), fmt(r.startup_s, 2),
            fmt(r.load1, 2)])
        for note in r.notes:
            report.note(f"{w.variant} {w.env} ({w.key}): {note}")
    report.section(
        "3. End to end",
        table(["variant", "env", "config", "SPS (median)", "windows min - max (n)", "bound",
               "of bound", "wall us/step", "core-us/step", "start s", "load"], rows),
        "`python -m monobeast|polybeast` in a subprocess with a huge --total_steps, stopped by "
        "SIGTERM; SPS = median over windows of (step difference / _time difference) between "
        "logs.csv rows after the warm-up. wall us/step = 1e6 / SPS; core-us/step = cores x "
        "1e6 / SPS (all cores, busy or not). start s: launch to the first log row. load: "
        "1-minute load average when the run was stopped (others share this machine).")
    return results


def section_profile(report, args, workdir, resolved, e2e_results, bounds, cores):
    section_profile_monobeast(report, args, e2e_results, cores)
    section_profile_polybeast(report, args, workdir, resolved, bounds)


def section_profile_monobeast(report, args, e2e_results, cores):
    """4a: MonoBeast's parts timed in this process, beside the end-to-end mono-null cost."""
    budget_s = 1.5 if args.quick else 5.0
    log("profile: MonoBeast's parts on Null-v0, in this process")
    rows, ctx = nullprofile.profile_monobeast(NULL_MODEL_ARGS, budget_s)
    total = sum(us for _, us, _ in rows)
    lines = []
    for side in ("actor", "hand-off", "learner"):
        side_rows = [(n, us) for n, us, s in rows if s == side]
        for name, us in side_rows:
            lines.append([side, name, fmt(us), f"{us / total:.0%}"])
        side_total = sum(us for _, us in side_rows)
        lines.append([side, "**subtotal**", f"**{fmt(side_total)}**", f"{side_total / total:.0%}"])
    lines.append(["all", "**sum: core-us per env step**", f"**{fmt(total)}**", "100%"])
    mono = e2e_results.get("mono-null")
    if mono is not None and mono.ok:
        measured = cores * 1e6 / mono.median
        lines.append(["end to end", f"MonoBeast Null-v0 measured ({cores} cores x wall us/step)",
                      fmt(measured), ""])
        lines.append(["end to end", "not in the parts (waiting, wake-ups, process switches, "
                      "logging, contention with other users)", fmt(measured - total), ""])
    report.section(
        "4a. Where a MonoBeast null-env step goes",
        table(["side", "part", "us per env step", "share"], lines),
        f"MonoBeast's own objects on Null-v0 with MLP {ctx['hidden_size']} in this process, "
        f"one intra-op thread: a Sampler with {ctx['envs_per_actor']} envs ({ctx['unrolls']} "
        f"unrolls of T={ctx['unroll_length']}), then get_batch + Learner.update + "
        "TrainingStats.record "
        f"({ctx['learner_steps']} steps, B={ctx['batch_size']}), each part timed by "
        "perf_counter wrappers. Costs are per env step; the learner's per step = per learner "
        "step / (T*B).")


def section_profile_polybeast(report, args, workdir, resolved, bounds):
    """4b: py-spy on a separate poly-null run. Optional: without PolyBeast or py-spy, a note."""
    poly = next((w for w in resolved if not isinstance(w, tuple) and w.key == "poly-null"), None)
    if poly is None:
        report.note("py-spy profile of PolyBeast skipped: PolyBeast could not be set up "
                    "(see the notes above).")
        return
    if not nullprofile.pyspy_available():
        report.note("py-spy profile of PolyBeast skipped: py-spy is not on PATH.")
        return
    seconds, rate = (4, 100) if args.quick else (10, 100)
    spy_path = os.path.join(workdir, "pyspy-poly-null.txt")
    spy, r = pyspy_polybeast(args, workdir, poly, bounds, seconds, rate, spy_path)
    if not spy or spy["status"] != 0 or not os.path.exists(spy_path):
        report.note(f"py-spy profile of PolyBeast failed: "
                    f"{spy.get('output') or r.reason or 'no output'}")
        return
    roles, leaves, total = nullprofile.summarize_pyspy(spy_path, seconds, rate)
    if total == 0:
        report.note("py-spy recorded no samples of PolyBeast.")
        return
    possible = seconds * rate
    role_rows = [[name, fmt(n / possible, 2), f"{n / total:.0%}"] for name, n in roles]
    leaf_rows = [[f"`{name}`", f"{n / total:.0%}"] for name, n in leaves]
    report.section(
        "4b. Where PolyBeast's null-env time goes (py-spy)",
        table(["process / thread", "busy threads (avg)", "share of samples"], role_rows)
        + "\n\n" + table(["innermost Python frame", "share of samples"], leaf_rows),
        f"`py-spy record --format raw --subprocesses --nonblocking --rate {rate}` for "
        f"{seconds} s on `python -m polybeast --env {poly.env} {' '.join(poly.args)}` (a separate "
        f"run; {total} samples of busy threads). busy threads = samples / (seconds x rate). "
        "Python frames only: libpolybeast's C++ actor threads and gRPC are visible only "
        "through Python calls that wait on them.")


def pyspy_polybeast(args, workdir, poly, bounds, seconds, rate, spy_path):
    """Runs `poly` again, py-spy recording it to spy_path from its first log row on.

    Returns (spy, run result): spy holds py-spy's "status" and "output", and is
    empty if the run never got to a first row.
    """
    spy = {}

    def record(pid):
        log(f"profile: py-spy record on PolyBeast (pid {pid}) for {seconds} s")
        spy["status"], spy["output"] = nullprofile.pyspy_record(pid, seconds, rate, spy_path)

    interval = log_interval_for(poly, bounds.get(poly.key), args.rows_per_second)
    spy_workload = endtoend.Workload("pyspy-poly-null", poly.variant, poly.env, poly.label,
                                     poly.args)
    # One second more than py-spy records, so that the run outlives the recording.
    r = endtoend.run_training(spy_workload, interval, seconds + 1, workdir, while_running=record,
                              log=log)
    return spy, r


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    args, selected, chosen, problems = parse_arguments(argv)
    if problems:
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2

    cores = machine.cores()
    started = time.monotonic()
    report = Report()
    header = machine_header(args, cores)
    ceil = ceilings.Ceilings(quick=args.quick, log=log)
    own_workdir = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="beast-bench-") if own_workdir else args.workdir
    os.makedirs(workdir, exist_ok=True)
    resolved = []
    if any(s in selected for s in ("inference", "bound", "e2e", "profile")):
        resolved = resolve_workloads(chosen)
    try:
        timings = run_sections(report, args, selected, ceil, resolved, cores, workdir)
    finally:
        if own_workdir and not args.keep_runs:
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.keep_runs or not own_workdir:
            log(f"run directories kept in {workdir}")

    markdown = render_report(header, report, started, timings)
    print(markdown)
    if args.output:
        with open(args.output, "w") as f:
            f.write(markdown)
        log(f"report written to {args.output}")
    return 0


def parse_arguments(argv):
    """(args with --quick's defaults filled in, sections to run, workloads to run,
    problems: a list of messages, empty if the arguments are usable)."""
    args = make_parser().parse_args(argv)
    if args.duration is None:
        args.duration = 15.0 if args.quick else 60.0
    if args.windows is None:
        args.windows = 5 if args.quick else 8
    selected = SECTIONS if args.only is None else tuple(
        s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in selected if s not in SECTIONS]
    all_workloads = workloads()
    chosen = all_workloads
    if args.workloads is not None:
        keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
        unknown += [k for k in keys if k not in {w.key for w in all_workloads}]
        chosen = [w for w in all_workloads if w.key in keys]
    if "e2e" in selected and "bound" not in selected:
        selected = selected + ("bound",)  # each end-to-end figure comes with its fraction of it
    problems = []
    if unknown:
        problems.append(f"unknown section or workload: {', '.join(unknown)}. Sections: "
                        f"{', '.join(SECTIONS)}; workloads: "
                        f"{', '.join(w.key for w in all_workloads)}.")
    return args, selected, chosen, problems + number_problems(args)


def number_problems(args):
    """What is wrong with the numeric arguments (a list of messages)."""
    problems = []
    if not args.duration > 0:
        problems.append(f"--duration must be positive (got {args.duration:g}).")
    if not 0 <= args.warmup_fraction < 1:
        problems.append(f"--warmup_fraction must lie in [0, 1) (got {args.warmup_fraction:g}).")
    if args.windows < 1:
        problems.append(f"--windows must be at least 1 (got {args.windows}).")
    if not args.rows_per_second > 0:
        problems.append(f"--rows_per_second must be positive (got {args.rows_per_second:g}).")
    return problems


def resolve_workloads(chosen):
    """Flags of each end-to-end configuration; (workload, reason) for one that cannot
    start (PolyBeast may not be ready: then its runs are skipped)."""
    resolved = []
    for w in chosen:
        try:
            resolved.append(endtoend.resolve(w))
        except BaseException as e:  # ImportError of libpolybeast, SystemExit of argparse
            if isinstance(e, KeyboardInterrupt):
                raise
            resolved.append((w, f"cannot set it up: {type(e).__name__}: {e}"))
    return resolved


def run_sections(report, args, selected, ceil, resolved, cores, workdir):
    """Runs the selected sections in order; returns how long each took ("<name> <n> s")."""
    timings = []

    def timed(name, fn, *fn_args):
        if name not in selected:
            return None
        log(f"section {name}")
        start = time.monotonic()
        try:
            return fn(*fn_args)
        except Exception as e:  # a broken section must not cost the others
            traceback.print_exc()
            report.note(f"section {name} failed: {type(e).__name__}: {e}")
            return None
        finally:
            timings.append(f"{name} {time.monotonic() - start:.0f} s")

    ready = [w for w in resolved if not isinstance(w, tuple)]
    timed("env", section_env, report, ceil, cores)
    timed("learner", section_learner, report, ceil, cores)
    needed = sorted({(w.net, w.inference_batch) for w in ready}, key=str)
    timed("inference", section_inference, report, ceil, needed)
    bounds = timed("bound", section_bound, report, ceil, ready, cores) or {}
    e2e_results = timed("e2e", section_e2e, report, args, resolved, bounds, cores,
                        workdir) or {}
    timed("profile", section_profile, report, args, workdir, resolved, e2e_results, bounds,
          cores)
    return timings


def render_report(header, report, started, timings):
    """The markdown report: the machine header, with the end's load and the wall
    times, then the sections and the notes."""
    header = header + [f"- load at end (uptime): {uptime()}",
                       f"- bench wall time: {time.monotonic() - started:.0f} s "
                       f"({', '.join(timings)})"]
    text = ["# Beast throughput benchmark", ""] + header + [""]
    text.append("\n\n".join(report.parts))
    if report.notes:
        text += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(text) + "\n"
