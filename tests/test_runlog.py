import argparse
import csv
import io
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from beast import runlog


def test_run_dir_paths(tmp_path):
    run_dir = runlog.RunDir(tmp_path / "runs", "exp1")
    assert run_dir.path == str(tmp_path / "runs" / "exp1")
    assert os.path.isdir(run_dir.path)
    assert run_dir.flags_path.endswith("exp1/flags.json")
    assert run_dir.meta_path.endswith("exp1/meta.json")
    assert run_dir.logs_path.endswith("exp1/logs.csv")
    assert run_dir.checkpoint_path.endswith("exp1/model.tar")
    assert run_dir.tb_dir.endswith("exp1/tensorboard")
    assert os.listdir(run_dir.path) == []  # the write probe is cleaned up


# A process that locks a run directory, forks a child that outlives it, says "locked" and
# exits when told to (or, with "orphan", right away, leaving its child running).
HOLDER = """
import os, sys, time
from beast import runlog
run_dir = runlog.RunDir(sys.argv[1], "exp")
run_dir.lock()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print("locked", child, flush=True)
if sys.argv[2] != "orphan":
    sys.stdin.readline()
"""


def _holder(tmp_path, mode):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), mode], cwd=repo,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    word, child = proc.stdout.readline().split()
    assert word == "locked"
    return proc, int(child)


def test_run_dir_lock_refuses_a_second_process_and_ends_with_the_first(tmp_path):
    proc, child = _holder(tmp_path, "wait")
    try:
        with pytest.raises(runlog.RunDirError) as info:
            runlog.RunDir(tmp_path, "exp").lock()
        message = str(info.value)
        assert f"pid {proc.pid} on host" in message and "--xpid" in message
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
        run_dir = runlog.RunDir(tmp_path, "exp")
        run_dir.lock()  # the holder is gone: free
        run_dir.lock()  # and again in the same process: a no-op
        with open(run_dir.lock_path) as f:
            assert f.read().startswith(f"pid {os.getpid()} on host")
        run_dir.unlock()
        assert os.path.exists(run_dir.lock_path)  # kept; see RunDir.unlock
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)


def test_run_dir_lock_is_not_kept_by_forked_children(tmp_path):
    """MonoBeast forks its actors: a child still running after the learner died must not
    hold the directory (an flock would be, since a fork shares the open file)."""
    proc, child = _holder(tmp_path, "orphan")
    try:
        assert proc.wait(timeout=30) == 0
        os.kill(child, 0)  # the child still runs
        runlog.RunDir(tmp_path, "exp").lock()
    finally:
        os.kill(child, signal.SIGKILL)


def test_generated_xpids_are_unique(tmp_path):
    first = runlog.RunDir(tmp_path, None)
    second = runlog.RunDir(tmp_path, None)
    assert first.xpid.startswith("beast-")
    assert first.path != second.path


def test_unwritable_savedir_names_path(tmp_path):
    # Tests run as root, so chmod would not stop writes; a file as the parent does.
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(runlog.RunDirError) as info:
        runlog.RunDir(blocker, "exp")
    message = str(info.value)
    assert str(blocker / "exp") in message
    assert "--savedir" in message
    assert isinstance(info.value, ValueError)


def test_metadata_keeps_earlier_starts(tmp_path):
    run_dir = runlog.RunDir(tmp_path, "exp")
    runlog.write_metadata(run_dir, argparse.Namespace(env="CartPole-v1", lr=0.1))
    runlog.write_metadata(run_dir, argparse.Namespace(env="CartPole-v1", lr=0.2))
    with open(run_dir.flags_path) as f:
        assert json.load(f)["lr"] == 0.2
    with open(run_dir.flags_path + ".1") as f:
        assert json.load(f)["lr"] == 0.1
    assert os.path.exists(run_dir.meta_path + ".1")
    with open(run_dir.meta_path) as f:
        meta = json.load(f)
    assert meta["versions"]["torch"] == torch.__version__
    for key in ("git_commit", "git_dirty", "hostname", "start_time", "command"):
        assert key in meta


def test_logs_columns_and_resume(tmp_path):
    run_dir = runlog.RunDir(tmp_path, "exp")
    logger = runlog.StatsLogger(run_dir, use_tensorboard=False)
    logger.log(10, {"total_loss": torch.tensor(1.5), "mean_episode_return": math.nan})
    logger.log(20, {"total_loss": 1.0, "mean_episode_return": 3.0})
    logger.close()
    with open(run_dir.logs_path) as f:
        assert f.readline().strip() == "_time,step,mean_episode_return,total_loss"

    # A resumed run appends below the existing rows, and a new key widens the header.
    logger = runlog.StatsLogger(run_dir, use_tensorboard=False)
    logger.log(30, {"total_loss": 0.5, "mean_episode_return": 4.0})
    logger.log(40, {"total_loss": 0.25, "mean_episode_return": 5.0, "eval_return": 7.0})
    logger.close()
    rows = runlog.read_logs(run_dir.logs_path)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert rows[0]["total_loss"] == 1.5
    assert math.isnan(rows[0]["mean_episode_return"])
    assert math.isnan(rows[2]["eval_return"])  # before the column existed
    assert rows[3]["eval_return"] == 7.0
    assert all(r["_time"] > 0 for r in rows)
    assert not os.path.exists(run_dir.logs_path + ".tmp")

    # A resume whose very first row brings a new column (a newer version of the code that
    # logs one more stat) widens the header before it appends.
    logger = runlog.StatsLogger(run_dir, use_tensorboard=False)
    logger.log(50, {"total_loss": 0.1, "mean_episode_return": 6.0, "policy_entropy": 0.5})
    logger.close()
    rows = runlog.read_logs(run_dir.logs_path)
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50]
    assert rows[4]["policy_entropy"] == 0.5 and math.isnan(rows[3]["policy_entropy"])
    assert rows[4]["total_loss"] == 0.1 and None not in rows[4]
    # Such a file written before the fix (a row wider than its header) still reads.
    with open(run_dir.logs_path, "a") as f:
        f.write("1.0,60,7.0,0.4,,0.05,9.9\n")  # one cell more than the header
    assert runlog.read_logs(run_dir.logs_path)[-1]["step"] == 60


def test_tensorboard_events_written(tmp_path):
    run_dir = runlog.RunDir(tmp_path, "exp")
    with runlog.StatsLogger(run_dir) as logger:
        logger.log(1, {"total_loss": 1.0, "mean_episode_return": math.nan})
    assert any(name.startswith("events.") for name in os.listdir(run_dir.tb_dir))


def test_a_resume_sets_aside_the_rows_logged_after_its_checkpoint(tmp_path, capsys):
    """A run killed after its checkpoint of step 30 had logged steps 40 and 50 too; the
    resume learns those steps again. logs.csv keeps one row per step, in order, and the rows
    of the killed start go to logs.after-checkpoint.csv, not away. A second such resume keeps
    the first one's file as .1."""
    run_dir = runlog.RunDir(tmp_path, "exp")
    with runlog.StatsLogger(run_dir, use_tensorboard=False) as logger:
        for step in (10, 20, 30, 40, 50):
            logger.log(step, {"total_loss": step / 100})
    with runlog.StatsLogger(run_dir, use_tensorboard=False, start_step=30) as logger:
        for step in (40, 50, 60):
            logger.log(step, {"total_loss": -step / 100, "policy_entropy": 1.0})
    rows = runlog.read_logs(run_dir.logs_path)
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50, 60]
    assert [r["total_loss"] for r in rows[3:]] == [-0.4, -0.5, -0.6]  # the resumed start's
    aside = tmp_path / "exp" / "logs.after-checkpoint.csv"
    moved = runlog.read_logs(aside)
    assert [(r["step"], r["total_loss"]) for r in moved] == [(40, 0.4), (50, 0.5)]
    assert "2 rows" in capsys.readouterr().err

    with runlog.StatsLogger(run_dir, use_tensorboard=False, start_step=50) as logger:
        logger.log(60, {"total_loss": 0.0, "policy_entropy": 2.0})
    assert [r["step"] for r in runlog.read_logs(run_dir.logs_path)] == [10, 20, 30, 40, 50, 60]
    assert [r["step"] for r in runlog.read_logs(aside)] == [60]
    assert [r["step"] for r in runlog.read_logs(f"{aside}.1")] == [40, 50]
    # Nothing past the checkpoint (a run stopped cleanly checkpoints last): nothing moves.
    with runlog.StatsLogger(run_dir, use_tensorboard=False, start_step=60):
        pass
    assert not os.path.exists(f"{aside}.2")
    assert not [name for name in os.listdir(run_dir.path) if name.endswith(".tmp")]
    # A start killed before its first checkpoint: the next one starts from step 0.
    with runlog.StatsLogger(run_dir, use_tensorboard=False, start_step=0) as logger:
        logger.log(10, {"total_loss": 0.0})
    assert [r["step"] for r in runlog.read_logs(run_dir.logs_path)] == [10]
    assert [r["step"] for r in runlog.read_logs(aside)] == [10, 20, 30, 40, 50, 60]


def test_a_resume_hides_the_tensorboard_events_after_its_checkpoint(tmp_path, monkeypatch):
    """TensorBoard reads one value per step: the killed start's events past the checkpoint
    are purged when the resumed start's writer begins. Its event files are read in the order
    of their names, whose counter field here goes from 9 to 10, which sorts first: only a
    resume's file made in a later second than the earlier start's is read after it."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.summary.writer import event_file_writer

    counter = iter(range(9, 100))
    monkeypatch.setattr(event_file_writer._global_uid, "get", lambda: next(counter))
    run_dir = runlog.RunDir(tmp_path, "exp")
    with runlog.StatsLogger(run_dir) as logger:
        for step in (10, 20, 30, 40, 50):
            logger.log(step, {"total_loss": 1.0})
    with runlog.StatsLogger(run_dir, start_step=30) as logger:
        for step in (40, 50, 60):
            logger.log(step, {"total_loss": 2.0})
    events = event_accumulator.EventAccumulator(run_dir.tb_dir)
    events.Reload()
    scalars = events.Scalars("total_loss")
    assert [(s.step, s.value) for s in scalars] == [
        (10, 1.0), (20, 1.0), (30, 1.0), (40, 2.0), (50, 2.0), (60, 2.0)]


def test_episode_stats_window():
    stats = runlog.EpisodeStats(window=3)
    assert math.isnan(stats.mean_return())
    stats.add([1.0, 2.0], [10, 20])
    stats.add(torch.tensor([3.0, 4.0]), torch.tensor([30, 40]))
    assert stats.count == 4
    assert stats.mean_return() == pytest.approx(3.0)  # only 2, 3, 4
    assert stats.mean_length() == pytest.approx(30.0)
    restored = runlog.EpisodeStats(window=3)
    restored.load_state_dict(stats.state_dict())
    assert restored.count == 4 and restored.mean_return() == stats.mean_return()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_status_line_non_tty_is_bounded():
    stream = io.StringIO()  # not a terminal
    clock = FakeClock()
    status = runlog.StatusLine(1000, stream=stream, interval=30.0, clock=clock)
    for step in range(1000):
        clock.now += 1.0  # 1000 updates over 1000 "seconds"
        status.update(step + 1, {"mean_episode_return": 2.5, "total_loss": 0.125, "other": 9})
    status.close()
    status.close()
    lines = stream.getvalue().splitlines()
    assert 1 <= len(lines) <= 1000 // 30 + 1
    assert "\r" not in stream.getvalue()
    assert lines[0].startswith("step 30/1000 (3.0%)")
    assert "SPS 1" in lines[0] and "return 2.50" in lines[0] and "total_loss 0.125" in lines[0]


def test_status_line_starts_with_its_label():
    stream, clock = io.StringIO(), FakeClock()
    status = runlog.StatusLine(100, stream=stream, interval=1.0, clock=clock, label="bf16")
    status.update(0)
    clock.now += 2.0
    status.update(50, {"mean_episode_return": 1.0})
    assert stream.getvalue().startswith("bf16 | step 50/100 (50.0%) | SPS 25")


def test_status_line_tty_redraws_in_place():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    clock = FakeClock()
    status = runlog.StatusLine(100, stream=stream, clock=clock)
    for step in range(1, 4):
        clock.now += 1.0
        status.update(step * 10, {})
    status.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")


def test_logs_keep_every_row_through_a_full_disk(small_disk, capsys):
    """Rows logged while the disk is full wait and are written, in order, once it has
    space again (a new column among them too); no half row is left in the file."""
    run_dir = runlog.RunDir(small_disk.path, "exp")
    logger = runlog.StatsLogger(run_dir, use_tensorboard=False)
    stats = lambda step: {f"loss_{k}": step + k / 7 for k in range(16)}

    def steps_on_disk():
        with open(run_dir.logs_path) as f:
            rows = list(csv.DictReader(f))
        # A half row would have fields missing (None) or too many (a None key).
        assert all(None not in row and None not in row.values() for row in rows)
        return [int(row["step"]) for row in rows]

    for step in range(3):
        logger.log(step, stats(step))
    small_disk.fill()
    # tmpfs allocates whole pages, so the first rows may still fit in the file's last page;
    # 60 rows of about 300 bytes do not.
    for step in range(3, 63):
        logger.log(step, stats(step))
    logger.log(63, {**stats(63), "eval_return": 7.0})  # widens the header while full
    assert "cannot write" in capsys.readouterr().err
    written = steps_on_disk()
    assert written == list(range(len(written))) and len(written) < 63
    small_disk.free()
    logger.log(64, stats(64))
    assert "rows had waited" in capsys.readouterr().err
    assert steps_on_disk() == list(range(65))
    with open(run_dir.logs_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(row["loss_3"]) for row in rows] == pytest.approx([i + 3 / 7 for i in range(65)])
    assert [row["eval_return"] for row in rows[62:]] == ["", "7.0", ""]
    # Full again at the end: close says which rows are lost.
    small_disk.fill()
    for step in range(65, 125):
        logger.log(step, stats(step))
    logger.close()
    assert "rows (steps" in capsys.readouterr().err
    written = steps_on_disk()
    assert written == list(range(len(written))) and len(written) < 125
