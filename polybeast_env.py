"""Environment servers for PolyBeast.

    python -m polybeast_env --env CartPole-v1 --num_servers 4 --pipes_basename unix:/tmp/polybeast

starts --num_servers processes; server i listens at <pipes_basename>.i (unix sockets, reachable from
this machine only), or with --address HOST:PORT at HOST:PORT+i over TCP. The learner
(python -m polybeast) connects one actor thread to each address. A raw:PATH basename serves the
same messages without gRPC (csrc/raw_socket.h), as the servers a learner starts itself do. Data
path of one server:

    actor thread --gRPC (or raw) stream--> libpolybeast.EnvServer
        --> RolloutAdapter(create_env(flags), seed)
                                                        or  VectorEnv of envs_per_stream envs

A stream carries --envs_per_stream environments if given, else as many as the learner asks for when
it opens the stream (python -m polybeast asks for its own --envs_per_stream: 64 on CartPole), else
one, in TorchBeast's wire format (TorchBeast's learner asks for nothing).

Every stream gets its own environment, seeded from (--seed, server index, stream number), so a
reconnecting learner starts a fresh, differently seeded one. SIGTERM or Ctrl-C stops the servers
and exits with status 0.

A server process that dies while serving (a crash in an environment's C code, the OOM killer) is
started again on its address, with fresh seeds, and the learner's actor thread reconnects to it;
so is one whose environment has been in one step for --step_timeout_s (a hang), after it is killed.
If polybeast_env itself is killed, its servers notice and stop.
One that never came up (beast/restarts.py) stops every server, and the exit status is 1.
An address where no server can listen (a socket directory that does not exist, an address in
use) or an environment that cannot be created ends it before any server starts, with one
message and exit status 2; "serving" is said once every server listens.
Servers that other machines reach can serve TLS (--tls_cert, --tls_key, --tls_client_ca;
beast/tls.py).

The environment flags (--env, --env_backend, --episodic_life, ...) are the learners' own, declared
once in beast/flags.py (add_env_flags); a learner passes its values with beast.flags.env_flag_args.
Those left at None take the learners' default for the environment's kind (beast.flags.ENV_DEFAULTS).
"""

import argparse
import errno
import multiprocessing
import os
import signal
import socket
import stat
import sys
import threading
import time

import numpy as np

from beast import flags as beast_flags
from beast import restarts
from beast import tls
from beast.poly import addresses
from beast.poly.addresses import is_loopback, socket_path, split_host_port

PARENT_POLL_S = 0.5  # how often a server looks whether polybeast_env still runs
STREAM_SLOTS = 64  # streams per server whose steps are timed (more go unwatched)


def make_parser():
    parser = argparse.ArgumentParser(
        description="PolyBeast environment servers.",
        formatter_class=beast_flags.HelpFormatter,
    )
    beast_flags.add_env_flags(parser)  # the learners' own environment flags
    # Streams.
    parser.add_argument("--envs_per_stream", type=beast_flags.Number(int, low=1), default=None,
                        help="Environments behind each gRPC stream, stepped together and sent "
                             "as one batch (fewer round trips, larger inference batches). "
                             "Default: what the learner asks for when it opens the stream (python "
                             "-m polybeast asks for its own --envs_per_stream), else 1, "
                             "TorchBeast's one-environment wire format. Given, it overrides the "
                             "learner's request.")
    parser.add_argument("--seed", type=beast_flags.Number(int, low=0), default=0,
                        help="Base seed; each stream's environment gets one derived from it, the "
                             "server index and the stream number.")
    # Servers.
    parser.add_argument("--num_servers", type=beast_flags.Number(int, low=1), default=4,
                        help="Number of server processes, one address each.")
    parser.add_argument("--pipes_basename", type=str, default="unix:/tmp/polybeast",
                        help="Unix socket addresses: server i listens at <pipes_basename>.i. "
                             "unix:PATH serves gRPC (any learner, TorchBeast's included); "
                             "raw:PATH the same messages without gRPC, which only this "
                             "project's learner speaks, with less time per round trip."),
    parser.add_argument("--address", type=str, default=None,
                        help="Serve over TCP instead: HOST:PORT (or tcp:HOST:PORT); server i "
                             "listens at HOST:PORT+i. A non-loopback HOST accepts connections "
                             "from other machines, without authentication.")
    parser.add_argument("--step_timeout_s", type=beast_flags.Number(float, low=0), default=30.0,
                        help="A server whose environment has not finished a step (or reset) "
                             "for this long is killed and started again, as a hung environment "
                             "would otherwise keep its thread and its core for good; 0: never. "
                             "python -m polybeast passes its --stream_timeout_s.")
    parser.add_argument("--exit_with_parent", action="store_true",
                        help="Stop the servers when the process that started this one is gone "
                             "(python -m polybeast passes it, so a killed learner leaves no "
                             "servers behind).")
    tls.add_server_flags(parser)
    return parser


def server_address(flags, index):
    """The address of server `index`: "unix:PATH.index", "raw:PATH.index" or
    "HOST:PORT+index"."""
    if flags.address:
        host, port = split_host_port(flags.address)
        return f"{host}:{port + index}"
    if not socket_path(flags.pipes_basename):
        raise ValueError(f"--pipes_basename must be unix:PATH or raw:PATH, got "
                         f"{flags.pipes_basename!r}; use --address HOST:PORT for TCP")
    address = f"{flags.pipes_basename}.{index}"
    problem = addresses.socket_path_problem(address)
    if problem:
        raise ValueError(f"--pipes_basename: {problem}")
    return address


def server_addresses(flags):
    return [server_address(flags, i) for i in range(flags.num_servers)]


def resolve_env_flags(flags):
    """Creates flags.env once (an unknown id fails here, not in every stream) and fills the
    environment flags left at None (--episodic_life) with the learners' default for its kind
    (beast.flags.ENV_DEFAULTS). Returns flags; raises ValueError or ImportError."""
    from beast import envs  # here: importing polybeast_env stays free of gymnasium

    info = envs.env_info(flags)
    envs.fill_family_flags(flags)
    return beast_flags.apply_env_defaults(flags, info["kind"], names=beast_flags.env_flag_names())


class EnvFactory:
    """Called by the EnvServer (GIL held) for every new stream, with the number of environments
    the client asked for (envs_per_stream, None if it did not ask): a fresh RolloutAdapter for
    one gymnasium environment, else a beast.vector_envs VectorEnv (always for EnvPool). The
    server's own --envs_per_stream, when given, wins over the request."""

    def __init__(self, flags, server_index, life=0, stepping=None):
        self.flags = flags
        self.server_index = server_index
        self.life = life  # how often this server was restarted: new seeds each time
        self.streams = 0
        self.stepping = stepping
        self.free_slots = list(range(len(stepping)))[::-1] if stepping is not None else []

    def __call__(self, envs_per_stream=None):
        # Imported here: the parent process never needs gymnasium.
        from beast import envs, vector_envs

        # Below 2**31: some environments (MinAtar's NumPy seeding) refuse larger seeds.
        entropy = [self.flags.seed, self.server_index, self.streams] + [self.life] * (self.life > 0)
        seed = int(np.random.SeedSequence(entropy).generate_state(1)[0] % 2**31)
        self.streams += 1
        if self.flags.envs_per_stream is not None:
            num_envs, why = self.flags.envs_per_stream, "--envs_per_stream"
        elif envs_per_stream is not None:
            num_envs, why = envs_per_stream, "asked for by the learner"
        else:
            num_envs, why = 1, "the learner asked for nothing"
        print(f"polybeast_env: server {self.server_index} stream {self.streams}: {num_envs} "
              f"environment(s) ({why})", flush=True)
        if num_envs == 1 and self.flags.env_backend == "gymnasium":
            env = envs.RolloutAdapter(envs.create_env(self.flags), seed)
        else:
            env = vector_envs.create_vector_env(self.flags, num_envs, seed,
                                                name=f"env server {self.server_index}")
        if not self.free_slots:  # more streams than slots: this one goes unwatched
            return env
        return Watched(env, self.stepping, self.free_slots)


class Watched:
    """An adapter whose initial() and step() write when they began into a slot of a shared
    array (0 while none runs), so that polybeast_env, from outside, can tell a hung
    environment and kill its process: a step stuck in C code holds the GIL, and no thread of
    this process could. Everything else is the adapter's own (the server asks for num_envs,
    restarts and close)."""

    def __init__(self, env, stepping, free_slots):
        self.env, self.stepping, self.free_slots = env, stepping, free_slots
        self.slot = free_slots.pop()

    def initial(self):
        return self._timed(self.env.initial)

    def step(self, action):
        return self._timed(self.env.step, action)

    def _timed(self, method, *args):
        self.stepping[self.slot] = time.monotonic()  # CLOCK_MONOTONIC: one clock for all
        try:
            return method(*args)
        finally:
            self.stepping[self.slot] = 0.0

    def close(self):
        if self.slot is not None:
            self.free_slots.append(self.slot)
            self.slot = None
        if hasattr(self.env, "close"):
            self.env.close()

    def __getattr__(self, name):
        return getattr(self.env, name)


def serve(flags, address, server_index=0, life=0, parent_pid=None, stepping=None,
          listening=None):
    """Serves environments at `address` until SIGTERM/SIGINT (main thread) or the process ends.

    flags needs the environment flags (beast.flags.add_env_flags), seed and envs_per_stream
    (None: what the learner asks for, else 1). life: how often this server was restarted.
    parent_pid: stop once this process is gone. stepping: a shared float array with a slot
    per stream to watch (Watched). listening: an Event set once the server listens. Usable
    as a multiprocessing target; one that cannot listen exits with its message.
    """
    import libpolybeast

    tls_config = tls.server_config(flags)
    if not is_loopback(address):
        _warn_exposed(address, tls_config)
    server = libpolybeast.EnvServer(EnvFactory(flags, server_index, life, stepping), address,
                                    tls=tls_config)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: server.stop())
    if parent_pid is not None:
        restarts.when_orphaned(parent_pid, lambda: _stop_orphaned(server, address, parent_pid),
                               poll_s=PARENT_POLL_S)
    owns_address = True
    try:
        server.run(on_listening=None if listening is None else listening.set)
    except RuntimeError as error:  # it could not listen: the message says why
        # Refused because another server listens there: its socket is not ours to remove.
        owns_address = "address in use" not in str(error)
        sys.exit(f"polybeast_env: {error}")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if owns_address:
            _remove_socket(address)


def _warn_exposed(address, tls_config):
    """Says what a server that other machines can reach lets them do."""
    if tls_config is None:
        what = ("the traffic is neither authenticated nor encrypted (see --tls_cert and "
                "--tls_client_ca)")
    elif "root_certs" not in tls_config:
        what = ("TLS encrypts the traffic, but any client may connect; --tls_client_ca admits "
                "only learners with a certificate signed by it")
    else:
        return  # encrypted, and only learners with a certificate of --tls_client_ca connect
    print(f"polybeast_env: warning: listening on {address}, which other machines can reach; "
          f"{what}.", file=sys.stderr, flush=True)


def _stop_orphaned(server, address, parent_pid):
    """Stops a server whose polybeast_env is gone (killed with SIGKILL, it could not stop
    it): otherwise it would serve on, holding its address, and no learner would stop it."""
    print(f"polybeast_env: the process that started the server at {address} (pid {parent_pid}) "
          "is gone; stopping it", file=sys.stderr, flush=True)
    server.stop()


def _remove_socket(address):
    path = socket_path(address)
    if path:
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass


def _tls_problems(flags, addresses):
    """TLS needs TCP addresses (--address): unix sockets stay on this machine."""
    try:
        config = tls.server_config(flags)
    except ValueError as error:
        return [str(error)]
    if config is not None and any(socket_path(a) for a in addresses):
        return ["--tls_cert is for servers that other machines reach: give --address HOST:PORT "
                "(unix sockets stay on this machine)."]
    return []


def flag_problems(flags, parser):
    """Every problem with the flags, as validate_flags lists them: each numeric flag's range
    (beast.flags.range_problems), the addresses and the TLS files."""
    problems = beast_flags.range_problems(flags, parser)
    if any(problem.startswith("--num_servers ") for problem in problems):
        return problems  # it counts the addresses
    try:
        addresses = server_addresses(flags)
    except ValueError as error:
        problems.append(f"{error}.")
    else:
        problems += _tls_problems(flags, addresses)
    return problems


def listen_problem(address):
    """Why no server can listen at `address`, found before any starts (else each server would
    say it, after a page of gRPC's log): a unix socket's directory that does not exist or is
    not writable, or an address in use. None when none of these."""
    path = socket_path(address)
    which = "--pipes_basename" if path else "--address"
    in_use = (f"address in use: {address}; another env server listens there? stop it or pick "
              f"another {which}.")
    if path:
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            return (f"cannot listen at {address}: the directory {directory} does not exist; "
                    f"create it or pick another {which}.")
        if not os.access(directory, os.W_OK | os.X_OK):
            return (f"cannot listen at {address}: the directory {directory} is not writable; "
                    f"pick another {which}.")
        with socket.socket(socket.AF_UNIX) as probe:
            return in_use if probe.connect_ex(path) == 0 else None
    host, port = split_host_port(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        return f"cannot listen at {address}: {error.strerror or error}; pick another {which}."
    why = None
    for family, kind, proto, _, sockaddr in found:
        # As the server binds (SO_REUSEADDR, no SO_REUSEPORT): a port where another server
        # listens is refused, one that closed connections wait on is not.
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                return None  # the server listens on the addresses it can bind
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return in_use
                why = why or error.strerror
    return f"cannot listen at {address}: {why}; pick another {which}."


def refuse(message):
    """Ends polybeast_env with its one message and exit status 2, before any server starts."""
    print(f"polybeast_env: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None):
    parent = os.getppid()  # before anything slow: the parent may die while we start
    parser = make_parser()
    flags = parser.parse_args(argv)
    problems = flag_problems(flags, parser)
    if flags.address is not None and "pipes_basename" in beast_flags.explicit_flags(
            parser, sys.argv[1:] if argv is None else argv):
        problems.append("--address and --pipes_basename both say where to serve: give one.")
    if problems:
        refuse(beast_flags.FlagError(problems))
    addresses = server_addresses(flags)
    problem = next(filter(None, map(listen_problem, addresses)), None)
    if problem is not None:
        refuse(problem)
    try:
        resolve_env_flags(flags)
    except (ValueError, ImportError) as error:
        refuse(error)

    # spawn, not fork: each server starts its own gRPC runtime from scratch.
    servers = [ServerProcess(multiprocessing.get_context("spawn"), flags, address, i)
               for i, address in enumerate(addresses)]
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    failed = None
    try:
        for server in servers:
            server.start()
        announced = False
        while not stop.wait(0.5 if announced else 0.05):
            if not announced and all(s.listening.is_set() for s in servers):
                print(f"polybeast_env: serving {flags.env} at {', '.join(addresses)}", flush=True)
                announced = True
            if flags.exit_with_parent and os.getppid() != parent:
                print("polybeast_env: the process that started us is gone; stopping",
                      file=sys.stderr, flush=True)
                break
            failed = next((s for s in servers if not s.revive()), None)
            if failed is not None:
                break
    finally:
        for server in servers:
            server.terminate()  # SIGTERM: the server stops and the process exits 0
        for server in servers:
            server.join()
    sys.exit(1 if failed is not None else 0)


class ServerProcess:
    """One server's process, started again when it dies while serving (module docstring)."""

    def __init__(self, context, flags, address, index):
        self.context, self.flags, self.address, self.index = context, flags, address, index
        self.name = f"env-server-{index}"
        self.policy = restarts.RestartPolicy()
        self.process = None
        # When each stream's step began, 0 while none runs (Watched); no lock: one writer a slot.
        self.stepping = context.Array("d", STREAM_SLOTS, lock=False)
        self.listening = context.Event()  # set once it listened, and for good

    def start(self):
        self.stepping[:] = [0.0] * STREAM_SLOTS  # the steps of a killed process are no more
        self.process = self.context.Process(
            target=serve,
            args=(self.flags, self.address, self.index, self.policy.restarts, os.getpid(),
                  self.stepping, self.listening),
            name=self.name)
        self.started = time.monotonic()
        self.process.start()

    def hung_for(self):
        """Seconds the oldest step in progress has run; 0 when none runs."""
        began = [t for t in self.stepping if t > 0]
        return time.monotonic() - min(began) if began else 0.0

    def revive(self):
        """Starts the server again if it died, or kills it first if a step of its has hung
        for --step_timeout_s; False if it never came up (not started)."""
        timeout, hung = self.flags.step_timeout_s, self.hung_for()
        if self.process.is_alive() and timeout > 0 and hung > timeout:
            print(f"polybeast_env: {self.name} has been in one environment step for "
                  f"{hung:.0f} s (--step_timeout_s {timeout:g}); killing it",
                  file=sys.stderr, flush=True)
            self.process.kill()
            self.process.join(timeout=10)
        if self.process.is_alive():
            return True
        status = self.process.exitcode
        ran = time.monotonic() - self.started
        why_not = self.policy.why_not(ran)
        if why_not is not None:
            print(f"polybeast_env: {self.name} exited with status {status}; not starting it "
                  f"again: {why_not}; stopping the others", file=sys.stderr, flush=True)
            return False
        print(f"polybeast_env: {self.name} exited with status {status} after {ran:.0f} s of "
              f"serving; starting it again (restart {self.policy.restarts})",
              file=sys.stderr, flush=True)
        self.start()
        return True

    def terminate(self):
        if self.process is not None and self.process.is_alive():
            self.process.terminate()

    def join(self):
        if self.process is None:
            return
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


if __name__ == "__main__":
    main()
