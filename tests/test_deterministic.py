"""--deterministic: MonoBeast runs with actor processes that reproduce exactly.

The schedule (beast/lockstep.py) is checked on its own, for many layouts of actors,
environments and batch sizes; then two short CartPole runs with 2 actors must write the
same logs.csv, losses included.
"""

import argparse
import bisect
import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from torch import multiprocessing as mp

import monobeast
from beast import checkpoint as ckpt
from beast import lockstep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The only columns of logs.csv that read the clock: _time (when the row was written), sps
# (steps per second of wall time) and learner_wait (which a lockstep run does not write).
# Every other column must match to the last digit.
WALL_CLOCK_COLUMNS = {"_time", "sps", "learner_wait"}
LOSS_COLUMNS = ("total_loss", "pg_loss", "baseline_loss", "entropy_loss")


def make_lockstep(num_actors, envs_per_actor, batch_size, num_buffers=None):
    flags = argparse.Namespace(num_actors=num_actors, envs_per_actor=envs_per_actor,
                               batch_size=batch_size, num_buffers=None)
    flags.num_buffers = num_buffers or lockstep.lockstep_num_buffers(flags)
    return lockstep.Lockstep(mp.get_context("fork"), flags), flags


LAYOUTS = [(n, e, b) for n in (1, 2, 3) for e in (1, 3, 4, 32) for b in (1, 4, 6, 16)]


@pytest.mark.parametrize("num_actors,envs_per_actor,batch_size", LAYOUTS)
def test_schedule_neither_deadlocks_nor_overwrites_unlearned_rollouts(
        num_actors, envs_per_actor, batch_size):
    lockstep, flags = make_lockstep(num_actors, envs_per_actor, batch_size)
    per_round = num_actors * envs_per_actor
    version = lockstep.weights_for_round
    versions = [version(k) for k in range(2000)]
    assert versions[:2] == [0, 0] and versions == sorted(versions)
    for v in range(min(versions[-1], 500)):
        # The learner waits for this many rounds to be taken before it writes version v + 1:
        # the least k with V(k) > v.
        assert lockstep.rounds_up_to_version(v) == bisect.bisect_right(versions, v)
    for update in range(100):
        rollouts = lockstep.batch_rollouts(update)
        # Everything update u waits for is acted with versions <= u, which exist by then.
        assert version(max(rollouts) // per_round) <= update
        assert version(lockstep.rounds_up_to_version(update) - 1) <= update
        assert [r % flags.num_buffers for r in rollouts] == [
            lockstep.round_buffers(lockstep.actor_of(r), r // per_round)[r % envs_per_actor]
            for r in rollouts]
    for k in range(150):
        # Round k is written once version V(k) exists: rollouts before V(k) * B are learned.
        learned = version(k) * batch_size
        for r in range(k * per_round, (k + 1) * per_round):
            assert r - flags.num_buffers < learned, (k, r)


def test_one_buffer_fewer_would_overwrite_a_rollout_not_yet_learned():
    for num_actors, envs_per_actor, batch_size in LAYOUTS:
        lockstep, flags = make_lockstep(num_actors, envs_per_actor, batch_size)
        per_round = num_actors * envs_per_actor
        too_few = flags.num_buffers - 1
        assert any((k + 1) * per_round - 1 - too_few >= lockstep.weights_for_round(k) * batch_size
                   for k in range(200)), (num_actors, envs_per_actor, batch_size)


def test_flags_that_cannot_be_deterministic_are_refused_together(tmp_path, capsys):
    code = monobeast.main(["--env", "CartPole-v1", "--savedir", str(tmp_path), "--deterministic",
                           "--num_learner_threads", "2", "--num_actors", "2",
                           "--envs_per_actor", "3", "--batch_size", "4", "--num_buffers", "8"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--deterministic learns in one thread" in err
    assert "--deterministic needs --num_buffers of at least 14" in err
    assert not os.listdir(tmp_path)


def train(savedir, xpid, *args):
    cmd = [sys.executable, "-m", "monobeast", "--env", "CartPole-v1", "--savedir", str(savedir),
           "--xpid", xpid, "--no_progress", "--deterministic", *map(str, args)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    with open(os.path.join(savedir, xpid, "logs.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, "no rows written"
    return rows


@pytest.mark.slow
def test_two_runs_with_actors_write_the_same_logs(tmp_path):
    """Two actors, 3 environments each, batches of 4 (batches straddle rounds and
    actors), an LSTM (core states in the buffers) and offline evaluation (rows written
    between training rows): logs.csv matches except for the wall-clock columns."""
    args = ["--num_actors", 2, "--envs_per_actor", 3, "--batch_size", 4, "--unroll_length", 40,
            "--use_lstm", "--total_steps", 10_000, "--log_interval_steps", 400,
            "--eval_interval_steps", 2_500, "--eval_episodes", 2, "--seed", 3]
    first = train(tmp_path, "first", *args)
    second = train(tmp_path, "second", *args)
    assert first[0].keys() == second[0].keys()
    columns = set(first[0]) - WALL_CLOCK_COLUMNS
    expected = {"step", "mean_episode_return", "eval_mean_episode_return", *LOSS_COLUMNS}
    assert expected <= columns
    training_rows = [r for r in first if r["total_loss"]]
    assert len(training_rows) >= 20 and int(first[-1]["step"]) >= 10_000
    assert len({r["total_loss"] for r in training_rows}) == len(training_rows)  # real losses
    assert sum(1 for r in first if r["eval_mean_episode_return"]) == 4
    for a, b in zip(first, second, strict=True):
        assert {k: a[k] for k in columns} == {k: b[k] for k in columns}, (a, b)


@pytest.mark.slow
def test_ctrl_c_stops_a_deterministic_run_cleanly(tmp_path):
    """The learner thread sees the stop request while it waits on the schedule; the
    actors, which ignore SIGINT, are released; the checkpoint is written."""
    cmd = [sys.executable, "-m", "monobeast", "--env", "CartPole-v1", "--savedir", str(tmp_path),
           "--xpid", "s", "--no_progress", "--deterministic", "--total_steps", "100000000",
           "--log_interval_steps", "2000"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        logs = tmp_path / "s" / "logs.csv"
        deadline = time.time() + 120
        while time.time() < deadline and not (
                logs.exists() and len(logs.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert ckpt.load_checkpoint(str(tmp_path / "s" / "model.tar"))["step"] >= 2000
    assert "--xpid s" in stderr


@pytest.mark.parametrize("env_id", ["CrashingCartPole-v0", "LockHoldingCartPole-v0"])
@pytest.mark.slow
def test_a_dead_actor_ends_a_deterministic_run_with_one_message(tmp_path, env_id):
    """Restarted actors would act on another schedule: --deterministic is not restarted.
    Also when the actor died holding the schedule's lock, which it then holds for ever."""
    marker = tmp_path / "crash"
    marker.touch()  # tests/crash_env.py: every step kills its actor process
    env = dict(os.environ, BEAST_CRASH_MARKER=str(marker))
    result = subprocess.run(
        [sys.executable, "-m", "monobeast", "--savedir", str(tmp_path), "--xpid", "d",
         "--no_progress", "--deterministic", "--env", f"tests.crash_env:{env_id}",
         "--total_steps", "100000"], cwd=REPO, capture_output=True, text=True, env=env,
        timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "was killed by signal 9 (SIGKILL). With --deterministic" in result.stderr
