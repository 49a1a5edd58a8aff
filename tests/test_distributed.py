"""Several PolyBeast learner ranks on torch.distributed (gloo on the CPU).

In-process: the gradient all-reduce against the mean computed by hand, and rank 0's objects
reaching every rank. End to end: two ranks under torchrun train CartPole and resume; a
rank that is killed or stopped ends the other with a message that names it, and nothing
is left running; and, with network namespaces as two hosts (root only), env servers on one
host serve a learner on the other over TCP, and two learner ranks on two hosts rendezvous
over TCP and learn CartPole together.
"""

import json
import os
import pathlib
import pickle
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from beast import distributed
from beast import runlog

from bench import netns

REPO = pathlib.Path(__file__).resolve().parent.parent
WAIT_S = 240  # upper bound for anything a test waits on; never reached when things work
T, B = 20, 8
SHORT = ["--env", "CartPole-v1", "--num_actors", "1", "--unroll_length", str(T),
         "--batch_size", str(B), "--no_progress"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in distributed.ENV_VARS}
    env.update(TMPDIR=str(tmp_path), **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def leftovers(tmp_path):
    """Processes whose command line mentions tmp_path (learners, env servers)."""
    found = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split() if int(p) != os.getpid()]


def wait_for(condition, what, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# ----------------------------------------------------------------------------
# In-process: the collectives.

class Payload:
    """Pickle would rebuild it (and run its __reduce__); share must not."""


def _rank_main(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = distributed.Ranks(rank, 2, rank, "gloo", timeout_s=60)
    try:
        torch.manual_seed(rank)  # a different gradient on each rank
        model = torch.nn.Linear(3, 2)
        model(torch.randn(5, 3)).pow(2).sum().backward()
        model.bias.grad = None  # counts as zero
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters()]
        ranks.average_gradients(model.parameters())
        shared = ranks.share({"from": rank, "weights": torch.full((2,), float(rank)),
                              "note": ("a", 1, None)})
        shared["weights"] = shared["weights"].numpy()
        try:  # an arbitrary object is not rebuilt on any rank: it would run code
            ranks.share(Payload() if rank == 0 else None)
            refused = False
        except pickle.UnpicklingError:
            refused = True
        # As numpy arrays: tensors would travel as shared memory that dies with this process.
        results.put((rank, [g.numpy() for g in grads],
                     [p.grad.detach().numpy() for p in model.parameters()], shared, ranks.hosts,
                     refused))
    finally:
        ranks.close()


@pytest.mark.slow
def test_average_gradients_is_the_mean_over_ranks():
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    processes = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in (0, 1)]
    for p in processes:
        p.start()
    got = {}
    for _ in processes:
        rank, *rest = results.get()
        got[rank] = rest
    for p in processes:
        p.join(WAIT_S)
        assert p.exitcode == 0
    own = [got[r][0] for r in (0, 1)]
    for rank in (0, 1):
        _, averaged, shared, hosts, refused = got[rank]
        for i, grad in enumerate(averaged):
            np.testing.assert_allclose(grad, (own[0][i] + own[1][i]) / 2, rtol=1e-6)
        # Rank 0's object everywhere, tensors and plain types rebuilt.
        assert shared["from"] == 0 and shared["note"] == ("a", 1, None)
        np.testing.assert_array_equal(shared["weights"], [0.0, 0.0])
        assert refused
        assert hosts == (socket.gethostname(),) * 2
    assert not np.array_equal(own[0][0], own[1][0])  # the test compared different gradients


def test_shard_and_rank_seeds():
    addresses = [f"h:{p}" for p in range(5)]
    assert distributed.shard(addresses, 0, 2) == ["h:0", "h:2", "h:4"]
    assert distributed.shard(addresses, 1, 2) == ["h:1", "h:3"]
    assert distributed.rank_seed(7, 0) == 7  # one learner runs as before
    seeds = {distributed.rank_seed(7, r) for r in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**31 for s in seeds)


def test_restarts_need_a_store_of_their_own():
    """torchrun --max_restarts with the rendezvous store it shares by default is refused."""
    assert distributed.restarts_problem({}) is None  # a plain torchrun
    assert distributed.restarts_problem({"TORCHELASTIC_MAX_RESTARTS": "0",
                                         "TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
    assert distributed.restarts_problem({"TORCHELASTIC_MAX_RESTARTS": "3",
                                         "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    problem = distributed.restarts_problem({"TORCHELASTIC_MAX_RESTARTS": "3",
                                            "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem and "--rdzv_backend c10d" in problem


# ----------------------------------------------------------------------------
# End to end under torchrun.

def torchrun(tmp_path, *args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "polybeast", "--savedir",
            str(tmp_path / "runs"), "--xpid", "run", *args]


@pytest.mark.slow
def test_two_ranks_count_every_step_log_once_and_resume(tmp_path):
    env = child_env(tmp_path)
    done = subprocess.run(torchrun(tmp_path, *SHORT, "--total_steps", "4000"), cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "run"
    assert os.listdir(tmp_path / "runs") == ["run"]  # rank 1 wrote no run directory
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["world_size"] == 2 and len(meta["rank_hosts"]) == 2
    rows = runlog.read_logs(run_dir / "logs.csv")
    steps = [int(r["step"]) for r in rows if r.get("total_loss") not in (None, "")]
    # One update is T * B steps on each of the two ranks.
    assert steps and all(s % (2 * T * B) == 0 for s in steps)
    assert steps[-1] == 4160  # the first multiple of 2 * T * B at or above 4000
    assert "learner rank 1" in done.stderr  # the other rank reports its own throughput
    resumed = subprocess.run(torchrun(tmp_path, *SHORT, "--total_steps", "8000"), cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 4160" in resumed.stderr
    # Rank 1 continued from the checkpoint too: its first report is past it.
    rank1 = [int(line.split("step ")[1].split(",")[0]) for line in resumed.stderr.splitlines()
             if line.startswith("learner rank 1") and "SPS" in line]
    assert rank1 and rank1[0] > 4160
    assert int(runlog.read_logs(run_dir / "logs.csv")[-1]["step"]) >= 8000


def start_ranks(tmp_path, *args):
    """Two ranks as two plain processes (what torchrun's environment would tell them)."""
    port = free_port()
    processes = []
    for rank in (0, 1):
        env = child_env(tmp_path, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(tmp_path / f"rank{rank}.log", "w")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "polybeast", "--savedir", str(tmp_path / "runs"),
             "--xpid", "run", *args], cwd=REPO, env=env, stdout=log,
            stderr=subprocess.STDOUT))
        log.close()
    return processes


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_a_rank_that_dies_or_stops_stops_the_other(tmp_path, sig):
    ranks = start_ranks(tmp_path, *SHORT, "--total_steps", "100000000",
                        "--log_interval_steps", "1000", "--dist_timeout_s", "60")
    try:
        logs = tmp_path / "runs" / "run" / "logs.csv"
        wait_for(lambda: logs.exists() and len(runlog.read_logs(logs)) >= 2, "training",
                 timeout=WAIT_S)
        ranks[1].send_signal(sig)
        code = ranks[0].wait(WAIT_S)
        ranks[1].wait(WAIT_S)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    out = (tmp_path / "rank0.log").read_text()
    assert code == 2, out[-3000:]
    assert "learner rank 1 (host" in out, out[-3000:]
    if sig == signal.SIGTERM:
        assert "stopped on request" in out
    assert "Traceback" not in out
    # Both ranks' env servers are gone (rank 1's noticed their parent died).
    wait_for(lambda: not leftovers(tmp_path), "the env servers to stop", timeout=30)
    # Rank 0 kept its checkpoint of the run so far.
    assert (tmp_path / "runs" / "run" / "model.tar").exists()


# ----------------------------------------------------------------------------
# Two hosts: network namespaces joined by a veth pair.

needs_netns = pytest.mark.skipif(netns.reason() is not None, reason=str(netns.reason()))


@needs_netns
@pytest.mark.slow
def test_env_servers_on_another_host_over_tcp(tmp_path):
    env = child_env(tmp_path)
    with netns.Hosts() as hosts:
        port = free_port()
        servers = hosts.popen(0, [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1",
                                  "--num_servers", "2", "--address",
                                  f"{hosts.address[0]}:{port}"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        learner = hosts.popen(1, [sys.executable, "-m", "polybeast", "--savedir",
                                  str(tmp_path / "runs"), "--xpid", "run", "--no_progress",
                                  "--server_addresses",
                                  f"{hosts.address[0]}:{port},{hosts.address[0]}:{port + 1}",
                                  "--total_steps", "60000"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        _, err = learner.communicate(timeout=WAIT_S)
        assert learner.returncode == 0, err[-3000:]
        assert "reached over the network" in err  # the warning for non-loopback servers
        assert servers.poll() is None  # the servers outlive their learner
    rows = runlog.read_logs(tmp_path / "runs" / "run" / "logs.csv")
    assert int(rows[-1]["step"]) >= 60000
    assert not netns.Hosts().pids(0)  # the namespaces and what ran in them are gone


@needs_netns
@pytest.mark.slow
def test_two_learner_ranks_on_two_hosts_learn_cartpole(tmp_path):
    env = child_env(tmp_path)
    with netns.Hosts() as hosts:
        port = free_port()
        ranks = []
        for node in (0, 1):
            savedir = tmp_path / f"host{node}"  # each host its own disk
            ranks.append(hosts.popen(node, [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                f"--node_rank={node}", "--nproc_per_node=1", f"--master_addr={hosts.address[0]}",
                f"--master_port={port}", "-m", "polybeast", "--savedir", str(savedir),
                "--xpid", "run", "--no_progress", "--env", "CartPole-v1", "--num_actors", "2",
                # With the default 100k-step warm-up: without it the first, unclipped RMSprop
                # steps can make the policy deterministic at once (a return of 9.5, seed 3).
                "--total_steps", "400000", "--seed", "3"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=WAIT_S * 2) for p in ranks]
        for p, (_, err) in zip(ranks, outputs):
            assert p.returncode == 0, err[-3000:]
    assert not (tmp_path / "host1").exists()  # rank 1 writes nothing
    meta = json.loads((tmp_path / "host0" / "run" / "meta.json").read_text())
    assert meta["world_size"] == 2
    rows = runlog.read_logs(tmp_path / "host0" / "run" / "logs.csv")
    final = float(rows[-1]["mean_episode_return"])
    assert final >= 100, f"mean return {final} after {rows[-1]['step']} steps on 2 ranks"


# ----------------------------------------------------------------------------
# torchrun --max_restarts: the group starts again by itself and resumes.

def elastic_rank(node, endpoint, savedir, *args, max_restarts=2):
    """One node's torchrun (one learner rank) of a two-node group with its own store."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=run",
            f"--rdzv_conf=is_host={int(node == 0)}", f"--max_restarts={max_restarts}",
            "-m", "polybeast", "--savedir", str(savedir), "--xpid", "run", *args]


def one_value_per_step(run_dir):
    """Steps of logs.csv and of TensorBoard's total_loss, each checked to be strictly rising."""
    from tensorboard.backend.event_processing import event_accumulator
    steps = [int(r["step"]) for r in runlog.read_logs(run_dir / "logs.csv")]
    assert steps == sorted(set(steps)), "logs.csv holds a step twice or out of order"
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = [s.step for s in events.Scalars("total_loss")]
    assert scalars == sorted(set(scalars)), "TensorBoard holds a step twice"
    return steps


ELASTIC = [*SHORT, "--total_steps", "150000", "--log_interval_steps", "2000",
           "--checkpoint_interval_s", "5"]


@pytest.mark.slow
def test_max_restarts_start_a_killed_rank_again_and_resume(tmp_path):
    env = child_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    endpoint = f"127.0.0.1:{free_port()}"
    logs = [open(tmp_path / f"node{node}.log", "w") for node in (0, 1)]
    nodes = [subprocess.Popen(elastic_rank(node, endpoint, tmp_path / f"host{node}", *ELASTIC),
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
             for node, log in zip((0, 1), logs)]
    try:
        csv_path = tmp_path / "host0" / "run" / "logs.csv"
        wait_for(lambda: csv_path.exists() and len(runlog.read_logs(csv_path)) >= 5, "training")
        worker = subprocess.run(["pgrep", "-P", str(nodes[1].pid)], capture_output=True,
                                text=True).stdout.split()
        assert worker, "rank 1's torchrun has no worker"
        os.kill(int(worker[0]), signal.SIGKILL)
        codes = [p.wait(WAIT_S * 2) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    out = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], out[-3000:]
    assert "learner rank 1 (host" in out and "Resuming" in out, out[-3000:]
    steps = one_value_per_step(tmp_path / "host0" / "run")
    assert steps[-1] >= 150000
    assert not (tmp_path / "host1").exists()  # rank 1 wrote nothing, in either start


@pytest.mark.slow
def test_max_restarts_with_the_shared_store_are_refused(tmp_path):
    command = torchrun(tmp_path, *SHORT, "--total_steps", "4000")
    command.insert(3, "--max_restarts=1")  # --standalone: the c10d store, shared
    done = subprocess.run(command, cwd=REPO, env=child_env(tmp_path), capture_output=True,
                          text=True, timeout=WAIT_S)
    assert done.returncode != 0
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "runs" / "run" / "logs.csv").exists()


@needs_netns
@pytest.mark.slow
def test_max_restarts_ride_out_a_link_down_past_dist_timeout(tmp_path):
    """Rank 1's host cut off for longer than --dist_timeout_s: both ranks stop, and torchrun
    starts the group again once the link is back; it resumes from rank 0's checkpoint."""
    env = child_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with netns.Hosts() as hosts:
        endpoint = f"{hosts.address[0]}:{free_port()}"
        logs = [open(tmp_path / f"node{node}.log", "w") for node in (0, 1)]
        nodes = []
        for node, log in zip((0, 1), logs):
            command = elastic_rank(node, endpoint, tmp_path / f"host{node}", *ELASTIC,
                                   "--dist_timeout_s", "15")
            # Every host here has the machine's hostname: name each one's own address.
            command.insert(3, f"--local_addr={hosts.address[node]}")
            nodes.append(hosts.popen(node, command, cwd=REPO, env=env, stdout=log,
                                     stderr=subprocess.STDOUT))
        try:
            csv_path = tmp_path / "host0" / "run" / "logs.csv"
            wait_for(lambda: csv_path.exists() and len(runlog.read_logs(csv_path)) >= 5,
                     "training")
            hosts.link(1, up=False)
            time.sleep(30)
            hosts.link(1, up=True)
            codes = [p.wait(WAIT_S * 2) for p in nodes]
        finally:
            for log in logs:
                log.close()
    out = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], out[-3000:]
    assert "learner rank 1 (host" in out and "Resuming" in out, out[-3000:]
    assert one_value_per_step(tmp_path / "host0" / "run")[-1] >= 150000
