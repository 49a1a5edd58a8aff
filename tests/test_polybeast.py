"""PolyBeast end to end, each run as `python -m polybeast` in a subprocess: learning CartPole,
an Atari smoke run and its resume, shutdown on SIGTERM and SIGKILL, env servers started
elsewhere, an env server killed and restarted mid-run, and the errors a user can fix; in-process,
the lock that keeps inference off half-copied weights.

The rollouts themselves (layout, overlap, no rollout spanning a server restart) are checked in
test_actor_pool.py; here we check what the learner makes of them."""

import argparse
import contextlib
import glob
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import polybeast
import process_helpers
from beast import checkpoint as ckpt
from beast import flags as beast_flags
from beast import restarts
from beast import runlog
from beast import training
from beast.poly import acting_process
from beast.poly import inference_models
from beast.poly import layout as poly_layout

REPO = pathlib.Path(__file__).resolve().parent.parent
WAIT_S = 120  # upper bound for anything a test waits on; never reached when things work

# The repo's CartPole defaults as a user runs them, with 4 servers (64 environments per
# stream) and the default 1M-step schedule; the run stops as soon as it gets there, usually at
# 300k-500k steps.
CARTPOLE_LEARNS = ["--env", "CartPole-v1", "--num_actors", "4", "--total_steps", "1000000",
                   "--seed", "1"]


def command(*args):
    return [sys.executable, "-m", *args]


def polybeast_args(tmp_path, *args, xpid="run"):
    return ["polybeast", "--savedir", str(tmp_path / "runs"), "--xpid", xpid, "--no_progress",
            *args]


def child_env(tmp_path):
    """TMPDIR inside tmp_path: the socket directory a run creates is the test's to inspect."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run(tmp_path, *args, timeout=WAIT_S):
    """Runs python -m <args> to the end; returns the CompletedProcess (text output)."""
    return subprocess.run(command(*args), cwd=REPO, env=child_env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def start(tmp_path, name, *args):
    """Starts python -m <args> in its own session; stdout and stderr go to tmp_path/name.log."""
    log = open(tmp_path / f"{name}.log", "w")
    process = subprocess.Popen(command(*args), cwd=REPO, env=child_env(tmp_path), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process


def output(tmp_path, name):
    return (tmp_path / f"{name}.log").read_text()


def stop_group(process, sig=signal.SIGTERM):
    """Signals the process group of a process started by start() and reaps it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
    try:
        process.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(WAIT_S)


def wait_for(condition, what, process=None, log=None):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            pytest.fail(f"the process ended (status {process.returncode}) while waiting for "
                        f"{what}:\n{log() if log else ''}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n{log() if log else ''}")


def logs(run_dir):
    path = run_dir / "logs.csv"
    return runlog.read_logs(path) if path.exists() else []


def last_step(run_dir):
    rows = logs(run_dir)
    return int(rows[-1]["step"]) if rows else 0


def descendants(pid):
    """Pids of every living process below pid, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we looked
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_gone(pids):
    return process_helpers.wait_gone(pids, WAIT_S)


def checkpoint_step(run_dir):
    return int(ckpt.load_checkpoint(run_dir / "model.tar")["step"])


# ----------------------------------------------------------------------------------------------


class TwoHalves(torch.nn.Module):
    """Reads its two parameters with a pause between them: a weight copy that lands in the
    pause would show as two different values."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Parameter(torch.zeros(1000))
        self.second = torch.nn.Parameter(torch.zeros(1000))

    def forward(self, inputs, core_state):
        first = self.first.clone()
        time.sleep(0.0005)
        return (first, self.second.clone()), core_state


def test_inference_never_sees_half_copied_weights():
    models = inference_models.InferenceModels([TwoHalves(), TwoHalves()])
    source = TwoHalves()
    stop, seen = threading.Event(), []

    def forward(index):
        while not stop.is_set():
            (first, second), _ = models.forward(index, {}, ())
            seen.append((index, bool(torch.equal(first, second)), float(first[0])))

    threads = [threading.Thread(target=forward, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        for value in range(1, 300):
            with torch.no_grad():
                source.first.fill_(value)
                source.second.fill_(value)
            models.load_state_dict(source.state_dict())
            time.sleep(0.0002)
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive()
    assert {index for index, _, _ in seen} == {0, 1}
    assert all(same for _, same, _ in seen), "a forward pass saw weights half-way through a copy"
    assert len({value for _, _, value in seen}) > 10, "the copies and forward passes interleaved"
    for replica in models.replicas:
        assert float(replica.first.detach()[0]) == float(replica.second.detach()[0]) == 299


def test_inference_models_abandon_the_locks_of_a_dead_process():
    """A forked acting process that dies holding a replica's lock (SIGKILL mid forward pass)
    must not stall the learner: its weight copy gives up once the locks are abandoned, and
    fresh locks work again."""
    models = inference_models.InferenceModels([TwoHalves()], context=acting_process.FORK)
    holder = acting_process.FORK.Process(target=lambda: models.locks[0].acquire() and os._exit(0))
    holder.start()
    holder.join(WAIT_S)
    source = TwoHalves()
    with torch.no_grad():
        source.first.fill_(7)
    copied = threading.Thread(target=models.load_state_dict, args=(source.state_dict(),),
                              daemon=True)
    copied.start()
    copied.join(0.5)
    assert copied.is_alive(), "the lock of the dead process is still held"
    models.abandon()
    copied.join(WAIT_S)
    assert not copied.is_alive()
    models.renew_locks()
    models.load_state_dict(source.state_dict())
    assert float(models.replicas[0].first.detach()[0]) == 7


@pytest.mark.parametrize("start_method, context", [(None, "spawn"), ("spawn", "spawn"),
                                                    ("fork", None)])
def test_the_acting_process_of_a_learner_off_the_cpu_is_spawned(monkeypatch, start_method,
                                                                context):
    """A CUDA learner ("meta" stands in for it) spawns its acting process, whose replicas
    stay on the learner's device (a spawned child gets them through CUDA IPC); a fork could
    not use CUDA, so asking for one is refused with what to change."""
    monkeypatch.setattr(training, "build_model", lambda flags, env: torch.nn.Linear(2, 2))
    flags = argparse.Namespace(acting_start_method=start_method, acting_precision="fp32",
                               num_inference_threads=2)
    device = torch.device("meta")
    if context is None:
        with pytest.raises(training.UserError, match="--acting_start_method fork with the "
                                                     "learner on meta: a forked process"):
            polybeast.create_inference_models(flags, None, device)
        return
    models = polybeast.create_inference_models(flags, None, device)
    assert models.context is acting_process.SPAWN
    assert {p.device.type for r in models.replicas for p in r.parameters()} == {"meta"}


def test_a_learner_off_the_cpu_gets_a_copy_of_the_slot_which_goes_back_at_once():
    """A CPU learner learns on the shared slot itself, which goes back when it asks for the
    next batch; a learner on another device gets the batch on that device, and the slot goes
    back before its step, so that the acting process can fill it meanwhile."""
    acting = acting_process.ActorPoolProcess.__new__(acting_process.ActorPoolProcess)
    slot = ({"frame": torch.arange(6.0).reshape(3, 2)}, (torch.ones(1, 2, 4),))
    acting.slots = [slot]
    acting.full_reader, full_writer = acting_process.FORK.Pipe(duplex=False)
    free_reader, acting.free_writer = acting_process.FORK.Pipe(duplex=False)
    acting.read_lock, acting.write_lock = threading.Lock(), threading.Lock()
    acting.stopping = acting_process.FORK.RawValue("b", 0)

    full_writer.send(0)
    batch, state = next(acting.batches(torch.device("meta")))
    assert batch["frame"].device.type == "meta" and state[0].device.type == "meta"
    assert batch["frame"].shape == (3, 2) and state[0].shape == (1, 2, 4)
    assert free_reader.poll(1) and free_reader.recv() == 0, "the slot did not go back"

    full_writer.send(0)
    on_cpu = acting.batches(torch.device("cpu"))
    batch, _ = next(on_cpu)
    assert batch["frame"] is slot[0]["frame"]
    assert not free_reader.poll(0.2), "the slot went back while the learner used it"
    acting.stopping.value = 1
    assert next(on_cpu, None) is None
    assert free_reader.poll(1) and free_reader.recv() == 0


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_learns_cartpole(tmp_path):
    """Mean return >= 400 over the last 100 episodes within 1M steps (usually 300k-500k; the
    budget leaves room for a slow seed of the race). The run is stopped with
    SIGTERM as soon as logs.csv shows it, which also checks that a stopped run keeps its logs."""
    run_dir = tmp_path / "runs" / "run"
    process = start(tmp_path, "learner", *polybeast_args(
        tmp_path, *CARTPOLE_LEARNS, "--log_interval_steps", "2000"))
    try:
        def learned():
            rows = logs(run_dir)
            return any(row["mean_episode_return"] >= 400 for row in rows)

        deadline = time.monotonic() + 540
        while process.poll() is None and not learned() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop_group(process)
    rows = logs(run_dir)
    assert rows, output(tmp_path, "learner")
    best = max(rows, key=lambda row: row["mean_episode_return"])
    assert best["mean_episode_return"] >= 400, (
        f"best mean return {best['mean_episode_return']:.1f} at step {best['step']:.0f}, "
        f"last step {rows[-1]['step']:.0f}")
    assert process.returncode == 0, output(tmp_path, "learner")
    assert checkpoint_step(run_dir) >= rows[-1]["step"]
    # The inference threads say which weights acted: never newer than the learner's.
    assert all(0 <= row["policy_lag"] < 100 for row in rows), [r["policy_lag"] for r in rows]
    assert all(0 <= row["learner_wait"] <= 1 for row in rows), [r["learner_wait"] for r in rows]


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_atari_smoke_run_and_resume(tmp_path):
    run_dir = tmp_path / "runs" / "pong"
    args = ["--env", "ALE/Pong-v5", "--num_actors", "2", "--batch_size", "4",
            "--unroll_length", "20", "--log_interval_steps", "80"]
    result = run(tmp_path, *polybeast_args(tmp_path, *args, "--total_steps", "640", xpid="pong"),
                 timeout=300)
    assert result.returncode == 0, result.stderr
    # The acting process stops when asked, not after the learner's deadline and a kill.
    assert "did not stop within" not in result.stderr, result.stderr
    rows = logs(run_dir)
    assert [int(row["step"]) for row in rows] == list(range(80, 641, 80))
    assert "mean_episode_return" in rows[0] and "total_loss" in rows[0]
    assert checkpoint_step(run_dir) == 640
    assert (run_dir / "flags.json").exists() and (run_dir / "meta.json").exists()

    result = run(tmp_path, *polybeast_args(tmp_path, *args, "--total_steps", "1280", xpid="pong"),
                 timeout=300)
    assert result.returncode == 0, result.stderr
    assert "from step 640" in result.stderr
    steps = [int(row["step"]) for row in logs(run_dir)]
    assert steps == list(range(80, 1281, 80)), "the resumed run must go on from step 640"
    assert checkpoint_step(run_dir) == 1280
    assert "did not stop within" not in result.stderr, result.stderr
    assert (run_dir / "flags.json.1").exists(), "the first start's flags are kept"


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_envpool_servers_with_several_environments_per_stream(tmp_path):
    """EnvPool behind the servers, 3 environments per stream: the learner gets [T+1, B]
    batches of rollouts from 2 x 3 environments, trains, and logs."""
    pytest.importorskip("envpool", reason="EnvPool is optional: pip install envpool")
    run_dir = tmp_path / "runs" / "ep"
    result = run(tmp_path, *polybeast_args(
        tmp_path, "--env", "ALE/Pong-v5", "--env_backend", "envpool", "--num_actors", "2",
        "--envs_per_stream", "3", "--batch_size", "6", "--unroll_length", "20",
        "--log_interval_steps", "240", "--total_steps", "1440", xpid="ep"), timeout=240)
    assert result.returncode == 0, result.stderr
    rows = logs(run_dir)
    assert [int(row["step"]) for row in rows] == list(range(240, 1441, 240))
    assert all(math.isfinite(row["total_loss"]) for row in rows)
    assert checkpoint_step(run_dir) == 1440


def server_commands(pids):
    """The command lines of the processes that still run."""
    commands = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                commands.append(f.read().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return commands


def start_training(tmp_path, *args):
    """A CartPole learner with 2 local servers, as good as endless (the caller stops it);
    returns the process once logs.csv has a row. args: extra flags."""
    process = start(tmp_path, "learner", *polybeast_args(
        tmp_path, "--env", "CartPole-v1", "--num_actors", "2", "--total_steps", "100000000",
        "--log_interval_steps", "500", *args))
    try:
        wait_for(lambda: last_step(tmp_path / "runs" / "run") > 0, "a row of logs.csv",
                 process, lambda: output(tmp_path, "learner"))
    except BaseException:
        stop_group(process, signal.SIGKILL)
        raise
    return process


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sigterm_stops_everything_and_checkpoints(tmp_path):
    """Also: the servers started here listen at raw:PATH."""
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path, "--checkpoint_interval_s", "100000")
    try:
        socket_dirs = glob.glob(str(tmp_path / f"polybeast-{process.pid}-*"))
        assert len(socket_dirs) == 1, "the run makes its socket directory under TMPDIR"
        servers = descendants(process.pid)
        assert any(f"--pipes_basename raw:{socket_dirs[0]}/env" in command
                   for command in server_commands(servers)), server_commands(servers)
        assert len(servers) >= 3, "polybeast_env and its two servers"
        assert not (run_dir / "model.tar").exists()
        process.send_signal(signal.SIGTERM)
        process.wait(WAIT_S)
    finally:
        stop_group(process, signal.SIGKILL)
    assert process.returncode == 0, output(tmp_path, "learner")
    assert "Stopping on request" in output(tmp_path, "learner")
    assert checkpoint_step(run_dir) >= last_step(run_dir) > 0
    assert wait_gone(servers) == [], "env server processes outlived the learner"
    assert not os.path.exists(socket_dirs[0]), "the socket directory was left behind"


@pytest.mark.timeout(300)
def test_killed_learner_leaves_no_servers(tmp_path):
    """SIGKILL gives the learner no chance to clean up: the servers notice on their own."""
    process = start_training(tmp_path)
    try:
        servers = descendants(process.pid)
        assert servers
    finally:
        stop_group(process, signal.SIGKILL)
    # Only the learner's own process group was killed: the servers run in their own session.
    assert wait_gone(servers) == [], "env server processes outlived a killed learner"


def acting_pid(learner_pid):
    """The pid of the learner's acting process (named "acting"), or None."""
    for pid in descendants(learner_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "acting" and process_helpers.alive(pid):
                    return pid
        except OSError:
            pass
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.slow
def test_a_killed_acting_process_is_started_again(tmp_path, start_method):
    """SIGKILL to the acting process (the actor threads and inference; what the OOM killer
    might pick): a warning, a new acting process with the learned weights, and the steps go
    on; twice, so that one of the kills is likely to land while it holds a lock of the acting
    model (the one-lock case is test_inference_models_abandon_the_locks_of_a_dead_process).
    spawn: as a CUDA learner starts it (here on the CPU), the model and the slots pickled
    across, the locks named semaphores."""
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path, "--acting_start_method", start_method)
    log = lambda: output(tmp_path, "learner")  # noqa: E731
    try:
        killed = []
        for _ in range(2):
            pid = wait_for(lambda: acting_pid(process.pid) not in (None, *killed),
                           "a new acting process", process, log) and acting_pid(process.pid)
            # Past restarts.QUICK_EXIT_S: a process that served, not one that never came up.
            time.sleep(restarts.QUICK_EXIT_S + 1)
            step = last_step(run_dir)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_for(lambda: last_step(run_dir) > step + 20000, "steps after the kill",
                     process, log)
        process.send_signal(signal.SIGTERM)
        process.wait(WAIT_S)
    finally:
        stop_group(process, signal.SIGKILL)
    assert process.returncode == 0, log()
    assert log().count("The acting process (actor threads and inference) was killed by signal 9 "
                       "(SIGKILL) while the run went on. Starting it again") == 2, log()
    assert "Traceback" not in log(), log()
    assert checkpoint_step(run_dir) >= last_step(run_dir)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_learner_killed_alone_leaves_no_acting_process(tmp_path):
    """SIGKILL to the learner's process only (its group lives on): the acting process sees
    that its parent is gone and ends, as the servers do."""
    process = start_training(tmp_path)
    try:
        acting = wait_for(lambda: acting_pid(process.pid), "the acting process", process,
                          lambda: output(tmp_path, "learner"))
        servers = [p for p in descendants(process.pid) if p != acting]
        process.kill()
        process.wait(WAIT_S)
        assert wait_gone([acting] + servers) == [], "processes outlived a killed learner"
    finally:
        stop_group(process, signal.SIGKILL)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_the_run_cleanly(tmp_path):
    """timeout(1) and Slurm signal the learner's whole process group: the acting process
    leaves the stopping to the learner, which checkpoints and stops it."""
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path, "--checkpoint_interval_s", "100000")
    try:
        acting = wait_for(lambda: acting_pid(process.pid), "the acting process", process,
                          lambda: output(tmp_path, "learner"))
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(WAIT_S)
    finally:
        stop_group(process, signal.SIGKILL)
    assert process.returncode == 0, output(tmp_path, "learner")
    assert "Stopping on request" in output(tmp_path, "learner")
    assert "Traceback" not in output(tmp_path, "learner")
    assert checkpoint_step(run_dir) >= last_step(run_dir) > 0
    assert wait_gone([acting]) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [["--acting_start_method", "spawn"],
                                   ["--acting_precision", "bf16"]], ids=["spawn", "bf16"])
@pytest.mark.slow
def test_the_acting_process_acts_with_the_learners_weights(tmp_path, flags):
    """The acting process acts with the weights the learner writes after each step, so the
    policy lag stays a few updates (a copy that never reached it would lag by every update),
    and CartPole learns: spawned (a CUDA learner's default, here on the CPU), and with its
    replicas in bf16, into which the learner's float32 weights are converted."""
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path, *flags)
    try:
        assert wait_for(lambda: acting_pid(process.pid), "the acting process", process,
                        lambda: output(tmp_path, "learner"))
        used = json.loads((run_dir / "flags.json").read_text())
        steps_per_update = used["batch_size"] * used["unroll_length"]
        wait_for(lambda: last_step(run_dir) >= 40 * steps_per_update and any(
                     float(r["mean_episode_return"] or 0) >= 100 for r in logs(run_dir)),
                 "40 updates and a mean return of 100", process,
                 lambda: output(tmp_path, "learner"))
        process.send_signal(signal.SIGTERM)
        process.wait(WAIT_S)
    finally:
        stop_group(process, signal.SIGKILL)
    assert process.returncode == 0, output(tmp_path, "learner")
    # Weights that never reached it would lag by more than 20 updates in the second half; a
    # machine busy with other tests can delay a fresh copy by about 10.
    rows = logs(run_dir)
    assert max(float(r["policy_lag"]) for r in rows[len(rows) // 2:]) < 15, rows[-1]
    assert "Traceback" not in output(tmp_path, "learner")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_servers_started_elsewhere(tmp_path):
    servers = start(tmp_path, "servers", "polybeast_env", "--env", "CartPole-v1",
                    "--num_servers", "2", "--pipes_basename", f"unix:{tmp_path}/env")
    try:
        wait_for(lambda: all(os.path.exists(tmp_path / f"env.{i}") for i in range(2)),
                 "the env servers' sockets", servers, lambda: output(tmp_path, "servers"))
        addresses = f"unix:{tmp_path}/env.0,unix:{tmp_path}/env.1"
        # Four actors over two servers: two streams, two environments, on each.
        result = run(tmp_path, *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--server_addresses", addresses,
            "--num_actors", "4", "--batch_size", "4", "--unroll_length", "20",
            "--total_steps", "800", "--log_interval_steps", "80"))
        assert result.returncode == 0, result.stderr
        assert last_step(tmp_path / "runs" / "run") == 800
        assert "authenticated" not in result.stderr, "unix sockets are local"
        # The same servers again, named by --pipes_basename as TorchBeast did.
        result = run(tmp_path, *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--no_start_servers", "--pipes_basename",
            f"unix:{tmp_path}/env", "--num_actors", "2", "--batch_size", "4",
            "--unroll_length", "20", "--total_steps", "400", "--log_interval_steps", "80",
            xpid="again"))
        assert result.returncode == 0, result.stderr
        assert last_step(tmp_path / "runs" / "again") == 400
        assert servers.poll() is None, "the learner must not stop servers it did not start"
    finally:
        stop_group(servers)
    assert servers.returncode == 0

    # --mode test plays with the checkpoint on its own; no servers needed.
    result = run(tmp_path, *polybeast_args(tmp_path, "--mode", "test", "--test_episodes", "1"))
    assert result.returncode == 0, result.stderr
    assert "Played 1 episodes" in result.stdout


def layout(monkeypatch, cores, *args):
    monkeypatch.setattr(poly_layout.beast_flags, "default_num_torch_threads", lambda: cores)
    flags = polybeast.make_parser().parse_args(["--env", "CartPole-v1", *args])
    poly_layout.default_layout(flags, "vector")
    return flags.num_actors, flags.envs_per_stream


def test_servers_by_hand_get_the_layout_of_servers_started_here(monkeypatch):
    """Fewer servers than DEFAULT_NUM_ACTORS (4), whether started here (one per core) or at
    --server_addresses, carry more environments per stream, so that 4 x 64 CartPole
    environments are in flight either way; more servers carry 64 each. An explicit
    --num_actors or --envs_per_stream is taken as given."""
    def addresses(n):
        return ["--server_addresses", ",".join(f"h:{4000 + i}" for i in range(n))]

    assert layout(monkeypatch, 2) == (2, 128)
    assert layout(monkeypatch, 2, *addresses(2)) == (2, 128)
    assert layout(monkeypatch, 16) == (4, 64)
    assert layout(monkeypatch, 16, *addresses(16)) == (16, 64)
    assert layout(monkeypatch, 2, *addresses(3)) == (3, 85)
    assert layout(monkeypatch, 2, "--num_actors", "2") == (2, 64)
    assert layout(monkeypatch, 2, *addresses(2), "--envs_per_stream", "8") == (2, 8)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_servers_started_elsewhere_get_the_learners_envs_per_stream(tmp_path):
    """Servers started by hand without --envs_per_stream host as many environments per stream
    as the learner asks for, not TorchBeast's one: on CartPole, with 3 addresses, 85, so that
    at least 4 x 64 are in flight (beast/poly/layout.py, default_layout). Servers started
    with their own --envs_per_stream keep it."""
    assert (poly_layout.DEFAULT_NUM_ACTORS, poly_layout.ENVS_PER_STREAM["vector"]) == (4, 64)
    servers = start(tmp_path, "servers", "polybeast_env", "--env", "CartPole-v1",
                    "--num_servers", "2", "--pipes_basename", f"unix:{tmp_path}/env")
    own = start(tmp_path, "own", "polybeast_env", "--env", "CartPole-v1", "--num_servers", "1",
                "--envs_per_stream", "3", "--pipes_basename", f"unix:{tmp_path}/own")
    try:
        for name, process in (("env.0", servers), ("env.1", servers), ("own.0", own)):
            wait_for(lambda: os.path.exists(tmp_path / name), f"the socket {name}", process,
                     lambda: output(tmp_path, "servers") + output(tmp_path, "own"))
        addresses = f"unix:{tmp_path}/env.0,unix:{tmp_path}/env.1,unix:{tmp_path}/own.0"
        result = run(tmp_path, *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--server_addresses", addresses,
            "--batch_size", "4", "--unroll_length", "20", "--total_steps", "400",
            "--log_interval_steps", "80"))
        assert result.returncode == 0, result.stderr
        assert last_step(tmp_path / "runs" / "run") == 400
    finally:
        stop_group(servers)
        stop_group(own)
    for index in range(2):  # one stream per server, as many actors as addresses
        assert (f"server {index} stream 1: 85 environment(s) (asked for by the learner)"
                in output(tmp_path, "servers")), output(tmp_path, "servers")
    assert "stream 1: 3 environment(s) (--envs_per_stream)" in output(tmp_path, "own")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["unix", "raw"])
@pytest.mark.slow
def test_env_server_killed_and_restarted(tmp_path, scheme):
    """With a single env server, training can only finish if the actors reconnect to it."""
    server_args = ["polybeast_env", "--env", "CartPole-v1", "--num_servers", "1",
                   "--pipes_basename", f"{scheme}:{tmp_path}/env"]
    socket = tmp_path / "env.0"
    run_dir = tmp_path / "runs" / "run"
    server = start(tmp_path, "server", *server_args)
    learner = None
    try:
        wait_for(socket.exists, "the env server's socket", server,
                 lambda: output(tmp_path, "server"))
        learner = start(tmp_path, "learner", *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--server_addresses", f"{scheme}:{socket}",
            "--num_actors", "2", "--batch_size", "4", "--unroll_length", "20",
            "--total_steps", "20000", "--log_interval_steps", "400"))
        wait_for(lambda: last_step(run_dir) > 0, "a row of logs.csv", learner,
                 lambda: output(tmp_path, "learner"))
        stop_group(server, signal.SIGKILL)  # polybeast_env and its server process, no cleanup
        steps_at_kill = last_step(run_dir)
        server = start(tmp_path, "server2", *server_args)  # the stale socket file is replaced
        learner.wait(WAIT_S)
    finally:
        if learner is not None:
            stop_group(learner, signal.SIGKILL)
        stop_group(server)
    err = output(tmp_path, "learner")
    assert learner.returncode == 0, err
    assert "lost the env server" in err and "reconnected" in err
    rows = logs(run_dir)
    assert int(rows[-1]["step"]) == 20000 > steps_at_kill
    assert checkpoint_step(run_dir) == 20000


def server_processes(pid):
    """The env server processes (polybeast_env's spawned children) below pid."""
    return [p for p, command in zip(descendants(pid), server_commands(descendants(pid)))
            if "spawn_main" in command]


def trains_on(tmp_path, process, run_dir, steps):
    """Waits until the learner's logs are 20,000 steps past `steps`."""
    wait_for(lambda: last_step(run_dir) > steps + 20000, "training to go on", process,
             lambda: output(tmp_path, "learner"))


def stop_cleanly(tmp_path, process):
    """Stops the learner with SIGTERM; returns its output once it has exited 0 without a
    traceback."""
    process.send_signal(signal.SIGTERM)
    process.wait(WAIT_S)
    err = output(tmp_path, "learner")
    assert process.returncode == 0, err
    assert "Traceback" not in err and "did not stop within" not in err, err
    return err


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_crashed_server_process_is_started_again(tmp_path):
    """A server process of the run's own that dies (here SIGKILL, as from the OOM killer or
    a crash in an environment's C code) is started again, its actor reconnects, and the run
    goes on to a clean stop."""
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path)
    try:
        time.sleep(restarts.QUICK_EXIT_S + 1)  # serving longer than a failed start
        first = server_processes(process.pid)
        assert len(first) == 2, server_commands(descendants(process.pid))
        os.kill(first[0], signal.SIGKILL)
        steps_at_kill = last_step(run_dir)
        wait_for(lambda: "reconnected" in output(tmp_path, "learner"), "the actor to reconnect",
                 process, lambda: output(tmp_path, "learner"))
        trains_on(tmp_path, process, run_dir, steps_at_kill)
        now = server_processes(process.pid)
        assert first[1] in now and first[0] not in now and len(now) == 2
        err = stop_cleanly(tmp_path, process)
    finally:
        stop_group(process, signal.SIGKILL)
    assert "env-server-0 exited with status -9" in err and "(restart 1)" in err


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_killed_polybeast_env_is_started_again_and_leaves_nothing_behind(tmp_path):
    """polybeast_env itself killed (SIGKILL: it cannot stop its servers): its servers stop on
    their own, the learner starts polybeast_env again, the actors reconnect, and when the run
    ends no process of either generation is left."""
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path)
    try:
        time.sleep(restarts.QUICK_EXIT_S + 1)  # serving longer than a failed start
        old_servers = server_processes(process.pid)
        below = descendants(process.pid)
        supervisors = [p for p, command in zip(below, server_commands(below))
                       if "-m polybeast_env" in command]
        assert len(old_servers) == 2 and len(supervisors) == 1, server_commands(below)
        os.kill(supervisors[0], signal.SIGKILL)
        steps_at_kill = last_step(run_dir)
        assert wait_gone(old_servers) == [], "servers outlived their polybeast_env"
        wait_for(lambda: "reconnected" in output(tmp_path, "learner"), "the actors to reconnect",
                 process, lambda: output(tmp_path, "learner"))
        trains_on(tmp_path, process, run_dir, steps_at_kill)
        new_servers = server_processes(process.pid)
        assert len(new_servers) == 2 and not set(new_servers) & set(old_servers)
        everything = descendants(process.pid)
        err = stop_cleanly(tmp_path, process)
    finally:
        stop_group(process, signal.SIGKILL)
    assert "exited with status -9" in err and "starting them again (restart 1)" in err
    assert wait_gone(everything) == [], "env server processes outlived the learner"


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_server_with_a_hung_environment_is_killed_and_started_again(tmp_path, monkeypatch):
    """An environment that stops answering (one step sleeps for an hour) would hold its
    server's thread and core for good: after --stream_timeout_s, which the learner passes to
    its servers as --step_timeout_s, polybeast_env kills that server and starts it again."""
    marker = tmp_path / "hang"
    monkeypatch.setenv("BEAST_CRASH_MARKER", str(marker))
    monkeypatch.setenv("BEAST_CRASH_ONCE", "1")
    run_dir = tmp_path / "runs" / "run"
    process = start_training(tmp_path, "--env", "tests.crash_env:HangingCartPole-v0",
                             "--stream_timeout_s", "3")
    try:
        time.sleep(restarts.QUICK_EXIT_S + 1)  # serving longer than a failed start
        first = server_processes(process.pid)
        assert len(first) == 2
        marker.touch()  # one step of one server hangs
        wait_for(lambda: not set(server_processes(process.pid)) >= set(first),
                 "the hung server to be killed", process, lambda: output(tmp_path, "learner"))
        assert not marker.exists()
        steps_at_kill = last_step(run_dir)
        trains_on(tmp_path, process, run_dir, steps_at_kill)
        now = server_processes(process.pid)
        assert len(now) == 2 and len(set(now) & set(first)) == 1
        err = stop_cleanly(tmp_path, process)
    finally:
        stop_group(process, signal.SIGKILL)
    assert "in one environment step for" in err and "(--step_timeout_s 3); killing it" in err
    assert "(restart 1)" in err


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_servers_stop_when_their_polybeast_env_is_killed(tmp_path):
    """A polybeast_env started by hand and killed with SIGKILL leaves no server serving on."""
    server = start(tmp_path, "server", "polybeast_env", "--env", "CartPole-v1",
                   "--num_servers", "2", "--pipes_basename", f"unix:{tmp_path}/env")
    try:
        wait_for(lambda: (tmp_path / "env.1").exists(), "the servers' sockets", server,
                 lambda: output(tmp_path, "server"))
        servers = server_processes(server.pid)
        assert len(servers) == 2
        server.kill()
        server.wait(WAIT_S)
        assert wait_gone(servers) == [], "servers outlived their polybeast_env"
    finally:
        stop_group(server, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # orphans, if the test failed
    assert not (tmp_path / "env.0").exists() and not (tmp_path / "env.1").exists()
    assert "is gone; stopping it" in output(tmp_path, "server")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_server_that_keeps_dying_stops_polybeast_env(tmp_path):
    """Restarts are for servers that served: one that dies again within QUICK_EXIT_S of
    each of MAX_QUICK_RESTARTS restarts in a row (beast/restarts.py) is given up, and
    polybeast_env exits 1."""
    server = start(tmp_path, "server", "polybeast_env", "--env", "CartPole-v1",
                   "--num_servers", "1", "--pipes_basename", f"unix:{tmp_path}/env")
    try:
        wait_for((tmp_path / "env.0").exists, "the server's socket", server,
                 lambda: output(tmp_path, "server"))
        time.sleep(restarts.QUICK_EXIT_S + 0.5)
        killed = []
        for _ in range(restarts.MAX_QUICK_RESTARTS + 1):
            pid = wait_for(lambda: [p for p in server_processes(server.pid) if p not in killed],
                           "a server process", server, lambda: output(tmp_path, "server"))[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        server.wait(WAIT_S)
    finally:
        stop_group(server, signal.SIGKILL)
    err = output(tmp_path, "server")
    assert server.returncode == 1, err
    assert err.count("; starting it again (restart") == restarts.MAX_QUICK_RESTARTS
    assert f"the last {restarts.MAX_QUICK_RESTARTS} starts each ended within" in err


@pytest.mark.slow
def test_unreachable_servers_end_the_run_with_one_message(tmp_path):
    address = f"unix:{tmp_path}/nobody"
    result = run(tmp_path, *polybeast_args(
        tmp_path, "--server_addresses", address, "--connect_timeout_s", "1",
        "--total_steps", "1000"))
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and address in result.stderr
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "runs" / "run"
    assert (run_dir / "flags.json").exists()
    assert checkpoint_step(run_dir) == 0


@pytest.mark.slow
def test_bad_flags_are_reported_together(tmp_path):
    result = run(tmp_path, *polybeast_args(
        tmp_path, "--num_actors", "0", "--num_inference_threads", "0",
        "--inference_torch_threads", "0", "--pipes_basename", "/tmp/not-a-unix-address",
        "--batch_size", "8", "--max_learner_queue_size", "2"))
    assert result.returncode == 2
    for flag in ("--num_actors", "--num_inference_threads", "--inference_torch_threads",
                 "--pipes_basename", "--max_learner_queue_size"):
        assert flag in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_socket_path_too_long_is_one_error_and_a_long_tmpdir_is_avoided(tmp_path):
    """A unix socket's path holds 107 bytes: a longer --pipes_basename is refused up front,
    and a run whose $TMPDIR is that long (a cluster job's scratch) puts its sockets in /tmp."""
    long_dir = tmp_path / ("d" * max(1, 110 - len(str(tmp_path))))
    long_dir.mkdir()
    result = run(tmp_path, *polybeast_args(tmp_path, "--pipes_basename", f"raw:{long_dir}/env"))
    assert result.returncode == 2
    assert "--pipes_basename: the socket path" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "run" / "flags.json").exists()
    result = run(long_dir, *polybeast_args(tmp_path, "--total_steps", "2000", xpid="tmpdir"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint_step(tmp_path / "runs" / "tmpdir") >= 2000


@pytest.mark.slow
def test_non_loopback_address_warns(tmp_path):
    result = run(tmp_path, *polybeast_args(
        tmp_path, "--server_addresses", "192.0.2.1:4000", "--connect_timeout_s", "1",
        "--total_steps", "1000"))
    assert "neither authenticated nor encrypted" in result.stderr
    assert result.returncode == 2


@pytest.mark.slow
def test_a_non_finite_loss_never_reaches_weights_or_checkpoint(tmp_path):
    """As in MonoBeast (huge rewards): skipped updates, one message, a checkpoint with finite
    weights."""
    result = run(tmp_path, *polybeast_args(
        tmp_path, "--env", "tests.flaky_env:HugeRewardCartPole-v0", "--num_actors", "2",
        "--envs_per_stream", "2", "--batch_size", "4", "--unroll_length", "20",
        "--total_steps", "400000", "--checkpoint_interval_s", "0",
        "--max_nonfinite_updates", "3", xpid="inf"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "3 learner updates in a row" in result.stderr
    state = ckpt.load_checkpoint(tmp_path / "runs" / "inf" / "model.tar")
    assert 0 < state["step"] < 400_000
    for name, value in state["model_state_dict"].items():
        assert torch.isfinite(value).all(), name


SERVERS_THAT_DO_NOT_FIT = {
    "other-env": ("rollout field 'frame'",
                  ["polybeast_env", "--env", "Acrobot-v1", "--num_servers", "1"]),
    "done-as-uint8": ("rollout field 'done'", ["tests.byte_done_server"]),
    "nan-frame": ("NaN or inf", ["tests.byte_done_server", "nan-frame"]),
    "bad-last-action": ("last_action outside", ["tests.byte_done_server", "bad-last-action"]),
}


@pytest.mark.parametrize("case", sorted(SERVERS_THAT_DO_NOT_FIT))
@pytest.mark.slow
def test_a_server_that_does_not_fit_ends_the_run_at_once(tmp_path, case):
    """A CartPole learner pointed at a server that sends other observations (Acrobot's [6]),
    `done` as uint8, a NaN observation or a last_action out of range: one message saying what
    did not fit, exit code 2, no hang and no abort."""
    message, server = SERVERS_THAT_DO_NOT_FIT[case]
    if server[0] == "polybeast_env":
        address = f"unix:{tmp_path}/env.0"
        server = server + ["--pipes_basename", f"unix:{tmp_path}/env"]
    else:
        address = f"unix:{tmp_path}/env"
        server = server[:1] + [address] + server[1:]
    servers = start(tmp_path, "servers", *server)
    try:
        wait_for(lambda: os.path.exists(address[len("unix:"):]), "the env server's socket",
                 servers, lambda: output(tmp_path, "servers"))
        started = time.monotonic()
        result = run(tmp_path, *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--server_addresses", address,
            "--batch_size", "4", "--unroll_length", "20", "--total_steps", "4000"))
        assert result.returncode == 2, result.stderr[-3000:]
        assert time.monotonic() - started < 30, "the error must end the run at once"
        assert message in result.stderr and "Traceback" not in result.stderr
    finally:
        stop_group(servers)


@pytest.mark.slow
def test_minatar_trains(tmp_path):
    """MinAtar's NumPy seeding refuses seeds of 2**32 and more: the seeds the servers derive
    stay below, and a run trains (it used to fail in every stream)."""
    pytest.importorskip("minatar", reason="MinAtar is optional: pip install minatar")
    result = run(tmp_path, *polybeast_args(
        tmp_path, "--env", "MinAtar/Breakout-v1", "--num_actors", "2", "--envs_per_stream", "2",
        "--batch_size", "4", "--unroll_length", "20", "--total_steps", "2000",
        "--log_interval_steps", "400"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_step(tmp_path / "runs" / "run") >= 2000


def test_learner_threads_with_local_servers_are_the_cores_they_leave(monkeypatch):
    """The servers keep a core each; at least one thread is left for the learner."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert beast_flags.default_num_torch_threads() == 8
    assert beast_flags.default_num_torch_threads(4) == 4
    assert beast_flags.default_num_torch_threads(8) == 1
    assert beast_flags.default_num_torch_threads(12) == 1


