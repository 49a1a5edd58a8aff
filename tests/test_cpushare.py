"""bench/cpushare.py: CPU time per process role of a running training, from /proc."""

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest

from bench import cpushare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A parent that sleeps, with a child that spins until killed.
TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_cpu_seconds_covers_the_whole_tree_and_names_the_roles():
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        spinner = int(parent.stdout.readline())
        assert cpushare.descendants(parent.pid) == {parent.pid, spinner}
        before = cpushare.cpu_seconds(parent.pid)
        time.sleep(1.0)
        after = cpushare.cpu_seconds(parent.pid)
    finally:
        subprocess.run(["kill", str(spinner)])
        parent.kill()
        parent.wait()

    def used(pid):
        return sum(after[key][2] - before.get(key, after[key])[2]
                   for key in after if key[0] == pid)

    assert {after[key][0] for key in after if key[0] == parent.pid} == {"learner process"}
    assert {after[key][0] for key in after if key[0] == spinner} == {
        "children (servers, actors, acting)"}
    assert used(spinner) > 0  # it spun (how much depends on the machine's load)
    assert used(parent.pid) < used(spinner)


def test_command_reports_sps_roles_and_idle_share():
    left_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "cpushare-*")))
    result = subprocess.run(
        [sys.executable, "-m", "bench.cpushare", "monobeast", "Null-v0", "--warmup_s", "6",
         "--window_s", "4", "--log_interval_steps", "2000", "--", "--model", "mlp",
         "--hidden_size", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "SPS" in out and "learner process" in out and "children" in out
    # The threads carry their names (beast.training.name_os_thread), so the cores split by
    # thread: MonoBeast's actor processes and its learner thread.
    assert "actor-0" in out and "actor-1" in out and "learner-0" in out
    assert "idle:" in out
    assert "learner waited for batches" in out  # logs.csv's learner_wait over the window
    # The run's directory (logs, checkpoint) goes with it.
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "cpushare-*"))) == left_before


def test_learner_wait_is_the_mean_of_the_window_rows():
    rows = [dict(_time=1.0, learner_wait=0.9), dict(_time=2.0, learner_wait=0.1),
            dict(_time=3.0, learner_wait=0.3), dict(_time=3.5, eval_mean_episode_return=1.0),
            dict(_time=4.0, learner_wait=0.8)]
    assert cpushare.learner_wait(rows, 1.0, 3.5) == pytest.approx(0.2)  # rows 2 and 3
    assert cpushare.learner_wait(rows, 4.0, 5.0) is None


def test_a_run_that_cannot_start_ends_with_its_own_message():
    result = subprocess.run(
        [sys.executable, "-m", "bench.cpushare", "monobeast", "Null-v0", "--warmup_s", "5",
         "--window_s", "1", "--", "--no_such_flag"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "the run ended during the warm-up" in result.stderr
    assert "--no_such_flag" in result.stderr and "Traceback" not in result.stderr
