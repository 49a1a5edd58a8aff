"""PolyBeast with env servers started by hand, on this host or another: as fast as with the
servers it starts itself?

    python -m bench.hosts                          # CartPole-v1, 30 s a run
    python -m bench.hosts --env ALE/Pong-v5 --duration 60

Runs one after another, each --duration seconds after its first logs.csv row (SPS: the median
over windows of rows, as in bench.endtoend):

  local          python -m polybeast --env ENV: the learner starts its servers (unix sockets).
  this host      servers started by hand (python -m polybeast_env --address 127.0.0.1:PORT),
                 as many processes as `local` has; the learner gets --server_addresses and the
                 --envs_per_stream of `local`, so both have the same environments in flight.
  other host     the same over TCP between two network namespaces joined by a veth pair, as
                 two hosts on one machine (needs root and iproute2; skipped otherwise).
  other host, TLS
                 the same with TLS both ways (--tls_cert, --tls_key and --tls_client_ca on the
                 servers, --tls_ca, --tls_cert and --tls_key on the learner; certificates made
                 with beast.tls; needs the openssl command, skipped otherwise).
  other host, learner's defaults
                 the README's multi-machine recipe as written: no --envs_per_stream, so the
                 servers get what the learner asks for servers elsewhere.

Servers and learner share this machine's cores in every row, and every row gets the learner's
intra-op threads of `local` (--num_torch_threads), so the rows differ in how the servers are
reached and, in the last, how many environments each stream carries. Prints a markdown table.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from bench import endtoend
from bench import netns
from beast import machine
from beast import tls

REPO = endtoend.REPO


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="CartPole-v1", help="--env of every run.")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="Seconds each run trains after its first logs.csv row.")
    parser.add_argument("--windows", type=int, default=6,
                        help="Windows of rows each run's SPS is the median of.")
    parser.add_argument("--log_interval_steps", type=int, default=None,
                        help="The runs' logs.csv interval (default: 8 unrolls of a batch, "
                             "T x B x 8).")
    return parser


def free_ports(count, host="127.0.0.1"):
    """A base port such that base .. base+count-1 are free on `host` now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def start_servers(env, count, host, port, workdir, prefix=(), args=()):
    """`count` env servers at host:port.. in their own session; returns (process, addresses)."""
    log = open(os.path.join(workdir, f"servers-{host}-{port}.out"), "w")
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", "polybeast_env", "--env", env, "--num_servers",
         str(count), "--address", f"{host}:{port}", *args],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process, ",".join(f"{host}:{port + i}" for i in range(count))


def stop_servers(process):
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def measure(key, env, args, options, workdir, interval, prefix=()):
    workload = endtoend.Workload(key, "polybeast", env, key, args)
    result = endtoend.run_training(workload, interval, options.duration, workdir,
                                   num_windows=options.windows, command_prefix=prefix,
                                   log=lambda m: print(f"[hosts] {m}", file=sys.stderr,
                                                       flush=True))
    if not result.ok:
        print(f"[hosts] {key}: {result.reason}", file=sys.stderr, flush=True)
    return result


def remote_rows(options, layout, interval, workdir):
    """(label, config, RunResult) of the runs with servers started by hand."""
    servers, per_stream, threads = layout
    threads = ["--num_torch_threads", str(threads)]
    same = [*threads, "--envs_per_stream", str(per_stream)]
    rows = []
    port = free_ports(servers)
    process, addresses = start_servers(options.env, servers, "127.0.0.1", port, workdir)
    try:
        rows.append(("this host, TCP loopback", f"{servers} servers x {per_stream}",
                     measure("thishost", options.env, ["--server_addresses", addresses, *same],
                             options, workdir, interval)))
    finally:
        stop_servers(process)
    why_not = netns.reason()
    if why_not is not None:
        print(f"[hosts] skipping the other-host rows: {why_not}", file=sys.stderr)
        return rows
    with netns.Hosts() as hosts:
        process, addresses = start_servers(options.env, servers, hosts.address[0], 4000,
                                           workdir, ("ip", "netns", "exec", hosts.names[0]))
        hosts.processes.append(process)
        learner = ("ip", "netns", "exec", hosts.names[1])
        common = ["--server_addresses", addresses, *threads]
        rows.append(("other host, TCP over a veth pair", f"{servers} servers x {per_stream}",
                     measure("otherhost", options.env, ["--server_addresses", addresses, *same],
                             options, workdir, interval, learner)))
        rows += tls_rows(options, hosts, (servers, per_stream), same, interval, workdir)
        default = endtoend.resolve(endtoend.Workload("d", "polybeast", options.env, "", common))
        rows.append(("other host, the learner's defaults",
                     f"{servers} servers x {default.flags.envs_per_stream}",
                     measure("otherhost-defaults", options.env, common, options, workdir,
                             interval, learner)))
    return rows


def tls_rows(options, hosts, layout, same, interval, workdir):
    """The other-host row again with TLS both ways, client certificates included."""
    if shutil.which("openssl") is None:
        print("[hosts] skipping the TLS row: no openssl command to make certificates",
              file=sys.stderr)
        return []
    servers, per_stream = layout
    certs = os.path.join(workdir, "certs")
    os.makedirs(certs)
    tls.make_ca(certs)
    tls.make_cert(certs, "server", hosts=[hosts.address[0]])
    tls.make_cert(certs, "learner")
    server_args = ["--tls_cert", f"{certs}/server.pem", "--tls_key", f"{certs}/server.key",
                   "--tls_client_ca", f"{certs}/ca.pem"]
    learner_args = ["--tls_ca", f"{certs}/ca.pem", "--tls_cert", f"{certs}/learner.pem",
                    "--tls_key", f"{certs}/learner.key"]
    process, addresses = start_servers(options.env, servers, hosts.address[0], 4100, workdir,
                                       ("ip", "netns", "exec", hosts.names[0]), server_args)
    hosts.processes.append(process)
    learner = ("ip", "netns", "exec", hosts.names[1])
    return [("other host, TLS with client certificates", f"{servers} servers x {per_stream}",
             measure("otherhost-tls", options.env,
                     ["--server_addresses", addresses, *same, *learner_args], options, workdir,
                     interval, learner))]


def main(argv=None):
    options = make_parser().parse_args(argv)
    local = endtoend.resolve(endtoend.Workload("local", "polybeast", options.env, "", []))
    flags = local.flags
    layout = (flags.num_actors, flags.envs_per_stream, flags.num_torch_threads)
    interval = options.log_interval_steps or 8 * flags.unroll_length * flags.batch_size
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory() as workdir:
        rows = [("local: the learner starts its servers (unix sockets)",
                 f"{flags.num_actors} servers x {flags.envs_per_stream}",
                 measure("local", options.env, [], options, workdir, interval))]
        rows += remote_rows(options, layout, interval, workdir)
    cpu, _ = machine.this_cpu()
    print(f"PolyBeast {options.env}, env servers reached {len(rows)} ways "
          f"(`python -m bench.hosts {' '.join(argv if argv is not None else sys.argv[1:])}`, "
          f"{started}, {cpu}, {machine.cores()} cores; learner intra-op threads "
          f"{flags.num_torch_threads} in every row):\n")
    print("| servers | layout | SPS (median) | windows min - max |")
    print("|---|---|---|---|")
    for label, config, result in rows:
        if result.windows:
            print(f"| {label} | {config} | {result.median:,.0f} | {min(result.windows):,.0f} - "
                  f"{max(result.windows):,.0f} |")
        else:
            print(f"| {label} | {config} | failed: {result.reason.splitlines()[0]} | |")
    return 0 if all(result.windows for _, _, result in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
