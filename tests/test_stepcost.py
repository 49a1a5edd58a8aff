"""bench/stepcost.py: the CPU time of stepping alone, whatever the thread does between batches."""

import argparse
import os
import subprocess
import sys
import time

from bench import stepcost

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spin(seconds):
    """Burns `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class SpinningEnvs:
    """A stand-in vector env whose step costs 1 ms of CPU."""

    def step(self, actions):
        spin(0.001)


def test_only_the_stepping_is_counted_not_the_forward_pass_or_the_wait():
    flags = argparse.Namespace(num_envs=2, seconds=0.3, wait_ms=2.0)
    actions = [[0, 0]]
    for pattern in ("tight", "forward", "sleep"):
        # The forward pass costs 5 ms of CPU: counted, it would make 3,000 us a step.
        cost = stepcost.run_pattern(pattern, SpinningEnvs(), actions, lambda: spin(0.005),
                                    flags)
        assert 450 < cost < 900, (pattern, cost)  # 1 ms / 2 envs, and a little overhead


def test_command_prints_every_pattern_against_tight():
    result = subprocess.run(
        [sys.executable, "-m", "bench.stepcost", "--env", "CartPole-v1", "--seconds", "0.3",
         "--rounds", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = result.stdout.split("against tight):")[1].split("\n")
    lines = {line.split()[0]: line.split() for line in summary if line.strip()}
    assert set(lines) == set(stepcost.PATTERNS)
    assert lines["tight"][2] == "1.00x"
    assert all(float(lines[p][1]) > 0 for p in stepcost.PATTERNS)
