"""The env servers a PolyBeast learner starts on its own machine: `python -m polybeast_env`
as a child process, started again when a signal kills it, stopped with the run."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from beast import distributed
from beast import flags as beast_flags
from beast import restarts
from beast import training
from beast.poly import addresses

SERVER_STOP_TIMEOUT_S = 15
# The repository's root, where polybeast_env.py and beast/ are, wherever we are run from.
CODE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LocalEnvServers:
    """`python -m polybeast_env` as a child process serving num_servers unix sockets.

    It runs in its own session, so a Ctrl-C meant for the learner does not stop
    the servers before the learner has closed its queues; --exit_with_parent
    makes it stop if this process dies without cleaning up (SIGKILL, OOM). If it
    is killed itself while serving, it is started again (beast/restarts.py), once
    what is left of its session (servers it could not stop) is gone.
    """

    def __init__(self, flags, num_servers):
        self.flags = flags
        self.num_servers = num_servers
        self.own_dir = None
        self.rank, world_size = distributed.env_rank()
        if flags.pipes_basename is None:
            self.own_dir = tempfile.mkdtemp(prefix=f"polybeast-{os.getpid()}-",
                                            dir=addresses.socket_dir(num_servers))
            # Raw messages on a unix socket: the actor threads read and write them
            # themselves, with fewer hand-offs per round trip than gRPC's.
            self.pipes_basename = f"raw:{self.own_dir}/env"
        else:
            self.pipes_basename = addresses.rank_basename(flags.pipes_basename, self.rank,
                                                          world_size)
        self.addresses = [f"{self.pipes_basename}.{i}" for i in range(num_servers)]
        self.process = None
        self.policy = restarts.RestartPolicy()

    def start(self):
        flags = self.flags
        command = [
            sys.executable, "-m", "polybeast_env",
            *beast_flags.env_flag_args(flags),  # the same environment as the learner's
            # Each learner rank's environments their own seeds (rank 0 keeps --seed).
            "--seed", str(distributed.rank_seed(flags.seed, self.rank)),
            "--num_servers", str(self.num_servers),
            "--envs_per_stream", str(flags.envs_per_stream),
            "--pipes_basename", self.pipes_basename,
            # An environment hung for as long as the actor waits is killed and restarted.
            "--step_timeout_s", str(flags.stream_timeout_s),
            "--exit_with_parent",
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE_DIR, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(command, env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL)
        self.started = time.monotonic()
        return self

    def exit_code(self):
        """None while the servers run."""
        return None if self.process is None else self.process.poll()

    def wait_until_listening(self, timeout_s, stop):
        """Blocks until every socket exists or `stop` is set. Raises UserError if the
        servers exit or do not listen within timeout_s."""
        paths = [addresses.socket_path(a) for a in self.addresses]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(p) for p in paths) and not stop.is_set():
            code = self.exit_code()
            if code is not None:
                raise training.UserError(
                    f"the env servers (python -m polybeast_env) exited with status {code} "
                    "before listening; their message is above.")
            if time.monotonic() > deadline:
                missing = [p for p in paths if not os.path.exists(p)]
                raise training.UserError(
                    f"the env servers did not listen within --connect_timeout_s "
                    f"{timeout_s:g} s (no socket at {', '.join(missing)}).")
            time.sleep(0.05)

    def check(self):
        """Starts polybeast_env again if a signal killed it while it served (the OOM killer);
        raises UserError if it exited by itself (a server that never came up: its message is
        above) or keeps dying."""
        code = self.exit_code()
        if code is None:
            return
        ran = time.monotonic() - self.started
        why_not = (self.policy.why_not(ran) if code < 0 else
                   "it stopped by itself")
        if why_not is not None:
            raise training.UserError(
                f"the env servers (python -m polybeast_env) exited with status {code} "
                f"({why_not}); their message is above.")
        print(f"warning: the env servers (python -m polybeast_env) exited with status {code} "
              f"after {ran:.0f} s; starting them again (restart {self.policy.restarts}).",
              file=sys.stderr, flush=True)
        self._stop_session()  # servers of the dead one must free their addresses first
        self.start()

    def _stop_session(self):
        """Ends every process left in polybeast_env's session (its process group): the
        servers of one that was killed before it could stop them. SIGTERM, then SIGKILL
        after SERVER_STOP_TIMEOUT_S."""
        deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                while time.monotonic() < deadline:
                    time.sleep(0.05)
                    os.killpg(self.process.pid, 0)  # raises once the group is empty
            except ProcessLookupError:
                return
            deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
        print(f"warning: processes of the env servers' group {self.process.pid} outlived "
              "SIGKILL.", file=sys.stderr)

    def stop(self):
        """Stops the servers and removes our socket directory; idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # polybeast_env stops its servers and exits
            try:
                self.process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"warning: the env servers (pid {self.process.pid}) did not stop within "
                      f"{SERVER_STOP_TIMEOUT_S} s; killing them.", file=sys.stderr)
                self.process.kill()
                self.process.wait(SERVER_STOP_TIMEOUT_S)
        if self.process is not None:
            self._stop_session()  # nothing of theirs outlives the run
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None


@contextlib.contextmanager
def local_env_servers(flags):
    """The env servers this run starts (None with --no_start_servers); stopped at exit."""
    if flags.mode != "train" or flags.no_start_servers:
        yield None
        return
    servers = LocalEnvServers(flags, flags.num_actors)
    try:
        yield servers.start()  # they boot while the learner builds its models
    finally:
        servers.stop()
