"""bench.solve: the wall time of a run measured over pieces, and a run in pieces end to end
(CartPole to a mean return of 150, stopped every few seconds and resumed)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from bench import solve

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_elapsed_counts_each_piece_from_its_launch():
    pieces = [[100.0, 110.0], [200.0, 230.0], [300.0, math.inf]]
    assert solve.elapsed_in(pieces, 105.0) == 5.0
    assert solve.elapsed_in(pieces, 210.0) == 20.0  # 10 s of the first piece, 10 of this
    assert solve.elapsed_in(pieces, 1000.0) == 740.0  # 40 s before, 700 in the running one
    assert math.isnan(solve.elapsed_in(pieces, 50.0))  # before the first launch
    assert math.isnan(solve.elapsed_in(pieces, 150.0))  # between pieces: a row written on
    # the way out, after the stop was asked for


def test_update_times_a_row_by_the_pieces_before_it():
    pieces = [[100.0, 110.0], [200.0, math.inf]]
    rows = [dict(_time=105.0, step=1000.0, mean=20.0),
            dict(_time=150.0, step=1500.0, mean=99.0),  # between pieces: not counted
            dict(_time=204.0, step=2000.0, mean=160.0),
            dict(_time=206.0, step=3000.0, mean=170.0)]
    result = solve.SolveResult(seed=0)
    assert solve.update(result, rows, pieces, target=150.0, time_limit_s=60.0)
    assert (result.wall_s, result.steps) == (14.0, 2000.0)
    assert result.best_mean == 170.0 and result.last_step == 3000.0

    late = solve.SolveResult(seed=0)  # the same rows, with a limit the target came after
    assert not solve.update(late, rows, pieces, target=150.0, time_limit_s=12.0)
    assert late.best_mean == 20.0


def run_solve(*args):
    return subprocess.run([sys.executable, "-m", "bench.solve", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_run_in_pieces_resumes_and_sums_its_wall_time(tmp_path):
    """A first piece of 0.5 s, shorter than any start-up, runs on until its run logs a row,
    then is stopped with its checkpoint (exit 3); the next invocation resumes the run until
    the target; then the same command reports the seed without running it. A mean of 400
    takes CartPole about 200k steps: many times what a fast machine steps before its first
    row."""
    def command(piece_s):
        return ["--seeds", "0", "--target", 400, "--time_limit_s", 240, "--piece_s", piece_s,
                "--workdir", tmp_path, "--", "--num_actors", 2]

    first = run_solve(*command(0.5))
    assert first.returncode == 3, first.stdout + first.stderr
    assert "paused after" in first.stdout and "the same command continues" in first.stdout
    second = run_solve(*command(200))
    assert second.returncode == 0, second.stdout + second.stderr
    savedir = tmp_path / "seed0"
    pieces = json.loads((savedir / solve.PIECES).read_text())
    assert len(pieces) == 2
    result = json.loads((savedir / solve.RESULT).read_text())
    assert result["solved"] and result["pieces"] == 2
    # Within the pieces' sum, and past the first piece: the target came in the second.
    assert pieces[0][1] - pieces[0][0] < result["wall_s"] <= sum(b - a for a, b in pieces)
    # Resumed, not started afresh: a second start of the same run directory.
    assert (savedir / "seed0" / "meta.json.1").exists()
    assert "Resuming" in (tmp_path / "seed0.out").read_text()

    again = run_solve(*command(200))
    assert again.returncode == 0 and "| 0 | yes |" in again.stdout, again.stdout
    assert len(json.loads((savedir / solve.PIECES).read_text())) == 2  # not run again


@pytest.mark.slow
def test_pieces_need_a_workdir():
    done = run_solve("--piece_s", 5)
    assert done.returncode == 2
    assert "--piece_s needs --workdir" in done.stderr


@pytest.mark.slow
def test_a_seed_past_its_time_limit_fails_and_is_kept_failed(tmp_path):
    """The limit bounds the run's whole wall time: a seed that cannot reach the target in
    it fails (exit 1), and the same command reports it again without running it."""
    command = ["--seeds", "0", "--target", 500, "--time_limit_s", 3, "--workdir", tmp_path]
    done = run_solve(*command)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "| 0 | no |" in done.stdout and "time limit" in done.stdout
    again = run_solve(*command)
    assert again.returncode == 1 and "time limit" in again.stdout
    assert len(json.loads((tmp_path / "seed0" / solve.PIECES).read_text())) == 1
