"""A link between the env servers' host and the learner's that drops and comes back.

Two hosts on this machine (bench/netns.py): env servers on host 0, a PolyBeast learner on
host 1, talking TCP over a veth pair; a partition is host 1's end of the pair set down (the
packets are dropped, no reset reaches either side). A server that has served the run is
retried for --reconnect_timeout_s while the run waits, and the run goes on once the link is
back; past that limit it stops with one message naming the addresses. Root only, slow tier.
"""

import csv
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from beast import checkpoint as ckpt
from beast import training
from bench import netns

REPO = pathlib.Path(__file__).resolve().parent.parent
WAIT_S = 240  # upper bound for anything a test waits on; never reached when things work
# Short timeouts, so that a partition of a few seconds outlasts all of them: a stream is
# cancelled after 2 s without a Step, a server that never served is given up after 3 s.
TIMEOUTS = ["--stream_timeout_s", "2", "--connect_timeout_s", "3"]

needs_netns = pytest.mark.skipif(netns.reason() is not None, reason=str(netns.reason()))
pytestmark = [needs_netns, pytest.mark.slow]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TMPDIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def logged_steps(run_dir):
    """The steps of logs.csv's training rows so far (evaluation rows have no sps)."""
    path = run_dir / "logs.csv"
    if not path.exists():
        return []
    with open(path) as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("sps")]


def wait_for(condition, what, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def start_run(tmp_path, hosts, *args):
    """Two env servers on host 0, a CartPole learner on host 1 that trains until stopped;
    returns (learner process, its run directory, the servers' addresses)."""
    env = child_env(tmp_path)
    port = free_port()
    addresses = [f"{hosts.address[0]}:{port}", f"{hosts.address[0]}:{port + 1}"]
    hosts.popen(0, [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1",
                    "--num_servers", "2", "--address", addresses[0]],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    learner = hosts.popen(1, [sys.executable, "-m", "polybeast", "--env", "CartPole-v1",
                              "--savedir", str(tmp_path / "runs"), "--xpid", "run",
                              "--no_progress", "--server_addresses", ",".join(addresses),
                              "--total_steps", str(10**9), "--log_interval_steps", "2000",
                              *TIMEOUTS, *args],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    return learner, tmp_path / "runs" / "run", addresses


# Steps after which every actor has completed rollouts, so that each server has served the
# run: 2 streams of 128 CartPoles, 80 steps a rollout, are 20,480 steps a round.
SERVED_STEPS = 60_000


def partition(hosts, learner, run_dir, seconds):
    """Waits until both servers have served the run, then cuts the link for `seconds`;
    returns the last step logged before the cut and the last one logged while it was down."""
    wait_for(lambda: max(logged_steps(run_dir) or [0]) >= SERVED_STEPS
             or learner.poll() is not None, "the servers to serve the run")
    assert learner.poll() is None, learner.communicate()[1][-3000:]
    before = logged_steps(run_dir)[-1]
    hosts.link(1, up=False)
    time.sleep(seconds)
    during = logged_steps(run_dir)[-1]
    assert learner.poll() is None, learner.communicate()[1][-3000:]
    return before, during


def stop(learner):
    learner.send_signal(signal.SIGTERM)
    _, err = learner.communicate(timeout=WAIT_S)
    return err


def test_a_partition_of_a_few_seconds_is_ridden_out(tmp_path):
    """12 s without the link, longer than --stream_timeout_s and --connect_timeout_s: the
    actors lose their servers and reconnect once the link is back, and training goes on from
    where it was, in the same run."""
    with netns.Hosts() as hosts:
        learner, run_dir, _ = start_run(tmp_path, hosts)
        before, during = partition(hosts, learner, run_dir, 12)
        hosts.link(1, up=True)
        # Progress again: rows beyond what the queues held when the link went down.
        wait_for(lambda: logged_steps(run_dir)[-1] >= during + 20_000 or learner.poll() is not None,
                 "training to go on after the link came back")
        assert learner.poll() is None, learner.communicate()[1][-3000:]
        err = stop(learner)
    assert learner.returncode == 0, err[-3000:]
    assert "lost the env server" in err and "reconnected" in err, err[-3000:]
    steps = logged_steps(run_dir)
    assert steps == sorted(set(steps)), "logs.csv repeats or reorders steps"
    # While the link is down the learner can only drain what was already rolled out: at most
    # one stream's 128 rollouts per actor blocked on the learner queue, the queue's 16 and a
    # slot's 16, 288 rollouts of 80 steps.
    assert during - before <= 288 * 80 + 2000, "the actors went on stepping while it was down"


def test_a_partition_longer_than_a_minute_writes_the_checkpoint_and_waits(tmp_path):
    """70 s without the link, longer than training.STALLED_S: the learner, with no batch
    coming, writes its checkpoint (a learner killed during the wait loses nothing) and goes
    on when the link is back."""
    assert training.STALLED_S < 70
    with netns.Hosts() as hosts:
        learner, run_dir, _ = start_run(tmp_path, hosts)
        _, during = partition(hosts, learner, run_dir, 70)
        # The checkpoint holds what the learner has learned so far, during the wait.
        saved = ckpt.load_checkpoint(run_dir / "model.tar")["step"]
        assert saved >= during
        hosts.link(1, up=True)
        wait_for(lambda: logged_steps(run_dir)[-1] >= saved + 20_000 or learner.poll() is not None,
                 "training to go on after the link came back")
        err = stop(learner)
    assert learner.returncode == 0, err[-3000:]
    assert f"the checkpoint of step {saved} is written. Waiting for rollouts." in err, err[-3000:]


def test_a_partition_past_reconnect_timeout_ends_the_run_naming_the_servers(tmp_path):
    """Past --reconnect_timeout_s the run stops with one message that names the address and
    the flag; logs.csv and the checkpoint keep everything learned."""
    with netns.Hosts() as hosts:
        learner, run_dir, addresses = start_run(tmp_path, hosts, "--reconnect_timeout_s", "8")
        _, during = partition(hosts, learner, run_dir, 0)
        _, err = learner.communicate(timeout=WAIT_S)
    assert learner.returncode == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert any(address in errors[0] for address in addresses), errors
    assert "could not reach the env server for 8 s since its last Step (reconnect_timeout_s)" in (
        err), err[-3000:]
    assert ckpt.load_checkpoint(run_dir / "model.tar")["step"] >= during
