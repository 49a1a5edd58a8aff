"""bench/drift.py: how CartPole's evaluation episodes end, and the report over seeds."""

import json
import os
import subprocess
import sys

import gymnasium
import numpy as np
import pytest

from bench import drift

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ends(path):
    with open(path) as f:
        return [json.loads(line)["end"] for line in f]


def episode_end(tmp_path, state, pid=None, max_steps=500):
    """Puts a CartPole in `state` (x, x_dot, theta, theta_dot), steps it once, returns what
    EndLog wrote (nothing if the episode goes on)."""
    path = tmp_path / "trace.jsonl"
    path.unlink(missing_ok=True)
    env = drift.EndLog(gymnasium.make("CartPole-v1", max_episode_steps=max_steps), str(path),
                       os.getpid() if pid is None else pid)
    env.reset(seed=0)
    env.unwrapped.state = np.array(state, dtype=np.float64)
    env.step(0)  # push left
    return ends(path) if path.exists() else []


def test_end_log_tells_the_cart_off_either_end_from_the_pole_down_and_the_limit(tmp_path):
    assert episode_end(tmp_path, [-2.39, -1.0, 0.0, 0.0]) == ["left"]
    assert episode_end(tmp_path, [2.39, 1.0, 0.0, 0.0]) == ["right"]
    assert episode_end(tmp_path, [0.0, 0.0, 0.2, 1.0]) == ["pole"]
    assert episode_end(tmp_path, [0.0, 0.0, 0.0, 0.0], max_steps=1) == ["limit"]
    assert episode_end(tmp_path, [0.0, 0.0, 0.0, 0.0]) == []  # goes on: nothing written


def test_end_log_writes_only_in_the_process_it_was_made_for(tmp_path):
    # The actor processes inherit the wrapper by fork; their training episodes stay out.
    assert episode_end(tmp_path, [-2.39, -1.0, 0.0, 0.0], pid=os.getpid() + 1) == []


def test_report_labels_each_evaluation_and_counts_the_side_switches(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "logs.csv").write_text(
        "step,mean_episode_return,eval_mean_episode_return,eval_episodes\n"
        "10000,20.0,,\n"            # a training row: owns no trace lines
        "20000,,150.0,2\n"
        "40000,,500.0,2\n"
        "60000,,140.0,2\n"
        "80000,,100.0,2\n"
        "2000000,,500.0,2\n")       # outside the window
    (run / "trace.jsonl").write_text("".join(json.dumps({"end": e}) + "\n" for e in [
        "left", "left", "limit", "limit", "right", "pole", "right", "right", "limit", "limit"]))
    evals = drift.evaluations(str(run), str(run / "trace.jsonl"))
    assert [step for step, _ in evals] == [20000, 40000, 60000, 80000, 2000000]
    assert [drift.label(c) for _, c in evals] == ["2L", "ok", "1P+1R", "2R", "ok"]
    lines = drift.report([(7, evals)], (0, 1_000_000))
    assert lines[0] == "seed 7: 0.02:2L 0.04:ok 0.06:1P+1R 0.08:2R"
    # Sides of the failed evaluations in order: left, right, right: one switch of two.
    assert ("2 reached the time limit, 6 failed: cart off the left end 2, off the right "
            "end 3, pole down 1" in lines[-1])
    assert "the side switched 1 times of 2" in lines[-1]


def test_a_short_run_traces_every_evaluation_episode_and_no_training_one(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.drift", "--seeds", "3", "--savedir", str(tmp_path),
         "--eval_interval_steps", "20000", "--eval_episodes", "2", "--window", "0,1000000",
         "--", "--total_steps", "60000", "--num_actors", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "drift-s3"
    evals = drift.evaluations(str(run), str(run / "trace.jsonl"))
    assert len(evals) >= 1
    # Exactly the evaluation episodes: the actors' hundreds of training episodes wrote nothing.
    assert len(ends(run / "trace.jsonl")) == 2 * len(evals)
    assert result.stdout.startswith("seed 3: ")
    assert "failed: cart off the left end" in result.stdout


def test_another_env_is_refused_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        drift.main(["--seeds", "0", "--", "--env", "Acrobot-v1"])
    assert exit_info.value.code == 2
    assert "CartPole-v1 only" in capsys.readouterr().err
