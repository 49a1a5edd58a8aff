"""PolyBeast's SPS when its env servers are far away: 0, 10 and 50 ms more round trip.

    python -m bench.latency                                  # CartPole and MinAtar Breakout
    python -m bench.latency --envs CartPole-v1 --rtt_ms 0,50 --duration_s 40
    python -m bench.latency --layouts "default=;wide=--num_actors 16"

Two hosts on this machine (bench/netns.py, root only): env servers on host 0 (one
`python -m polybeast_env --num_servers 2` over TCP), the learner on host 1, and on host 1
between them bench/delay_proxy.py, which holds each chunk of bytes for half the round trip
in each direction ("direct" skips the proxy, which shows what the proxy itself costs). Each
(environment, layout, round trip) trains for --duration_s after its first logs.csv row; the
SPS is that of the rows after --warmup_s. A layout is a name and the learner flags it adds;
the ratio is against the same layout at 0 ms. Measured, not asserted; run it alone.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from beast import machine
from bench import netns
from bench.partition import rows, sps_between

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# More streams hide the round trip: each stream waits one round trip per step, so the SPS is
# at most (environments in flight) / (round trip + step time). Given --num_actors, a stream
# carries the kind's default environments (layout.ENVS_PER_STREAM); with two servers, each of
# the default two streams carries twice that. The default layouts are CartPole's.
LAYOUTS = ("default=;4x environments per stream=--envs_per_stream 512;"
           "8 streams per server=--num_actors 16;16 streams per server=--num_actors 32")


def parse_layouts(text):
    layouts = []
    for entry in text.split(";"):
        name, _, flags = entry.partition("=")
        layouts.append((name.strip(), flags.split()))
    return layouts


def measure(hosts, workdir, env, flags, rtt, port, duration_s, warmup_s):
    """SPS of one learner on host 1 against the servers on host 0, through the proxy unless
    rtt is "direct"; the servers are started and stopped with it."""
    child_env = dict(os.environ, TMPDIR=workdir, PYTHONPATH=REPO)
    server = [f"{hosts.address[0]}:{port}", f"{hosts.address[0]}:{port + 1}"]
    started = [hosts.popen(0, [sys.executable, "-m", "polybeast_env", "--env", env,
                               "--num_servers", "2", "--address", server[0]],
                           cwd=REPO, env=child_env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)]
    addresses = server
    if rtt != "direct":
        addresses = [f"127.0.0.1:{port + 100}", f"127.0.0.1:{port + 101}"]
        proxy = hosts.popen(1, [sys.executable, "-m", "bench.delay_proxy", "--listen",
                                ",".join(addresses), "--to", ",".join(server), "--rtt_ms",
                                str(rtt)], cwd=REPO, env=child_env, stdout=subprocess.PIPE,
                            text=True)
        proxy.stdout.readline()  # "listening"
        started.append(proxy)
    run_dir = os.path.join(workdir, "runs", f"run{port}")
    with open(os.path.join(workdir, f"learner{port}.err"), "w") as err:
        learner = hosts.popen(1, [sys.executable, "-m", "polybeast", "--env", env, "--savedir",
                                  os.path.dirname(run_dir), "--xpid", os.path.basename(run_dir),
                                  "--no_progress", "--server_addresses", ",".join(addresses),
                                  "--total_steps", str(10**12), "--log_interval_steps", "2000",
                                  *flags], cwd=REPO, env=child_env,
                              stdout=subprocess.DEVNULL, stderr=err)
    started.append(learner)
    deadline = time.time() + 600
    while not rows(run_dir) and learner.poll() is None and time.time() < deadline:
        time.sleep(1)
    first = time.time()
    time.sleep(duration_s)
    for process in reversed(started):
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    logged = rows(run_dir)
    return sps_between(logged, first + warmup_s, first + duration_s)


def report(results, args, command):
    lines = ["# PolyBeast with env servers far away", "",
             f"- command: `{command}`",
             "- machine: " + ", ".join(f"{k} {v}" for k, v in machine.describe().items()),
             f"- each run: {args.duration_s:g} s after its first row, SPS from the rows after "
             f"the first {args.warmup_s:g} s; two env servers on one host, the learner on "
             "another, the round trip added between them", "",
             "| environment | layout | learner flags | round trip added | SPS | "
             "against 0 ms |", "|---|---|---|---|---|---|"]
    for (env, name, flags, rtt), sps in results.items():
        zero = results.get((env, name, flags, "0"))
        ratio = f"{sps / zero:.2f}" if zero and rtt != "direct" else ""
        shown = "direct (no proxy)" if rtt == "direct" else f"{rtt} ms"
        lines.append(f"| {env} | {name} | `{' '.join(flags) or '-'}` | {shown} | "
                     f"{sps:,.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default="CartPole-v1,MinAtar/Breakout-v1",
                        help="Comma-separated environments.")
    parser.add_argument("--rtt_ms", default="direct,0,10,50",
                        help="Comma-separated round trips added, in ms; 'direct' is no proxy "
                             "(measured for the first layout only).")
    parser.add_argument("--layouts", default=LAYOUTS,
                        help="Semicolon-separated NAME=FLAGS: the learner flags of each "
                             "layout.")
    parser.add_argument("--duration_s", type=float, default=60.0,
                        help="Training per measurement, after the first logs.csv row.")
    parser.add_argument("--warmup_s", type=float, default=15.0,
                        help="Training left out of the SPS at the start of each measurement.")
    parser.add_argument("--port", type=int, default=4600, help="The first port used.")
    parser.add_argument("--output", default=None, help="Also write the report here.")
    args = parser.parse_args(argv)
    problem = netns.reason()
    if problem:
        parser.error(problem)
    results, port = {}, args.port
    command = "python -m bench.latency " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as workdir, netns.Hosts() as hosts:
        for env in args.envs.split(","):
            for index, (name, flags) in enumerate(parse_layouts(args.layouts)):
                for rtt in args.rtt_ms.split(","):
                    if rtt == "direct" and index > 0:
                        continue  # what the proxy costs: the first layout shows it
                    sps = measure(hosts, workdir, env, flags, rtt, port, args.duration_s,
                                  args.warmup_s)
                    results[(env, name, tuple(flags), rtt)] = sps
                    print(f"{env} | {name} | {rtt}: {sps:,.0f} SPS", flush=True)
                    port += 2
    text = report(results, args, command)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
