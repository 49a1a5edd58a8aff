"""The grid launcher (bench/launch.py) and the learning benchmark's report (bench/learn.py).

The launcher tests start real `python -m monobeast` runs with tiny flags (a few seconds each);
the aggregation tests read hand-made logs.csv files and launch nothing.
"""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from beast import runlog
from bench import launch, learn, null_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The brief's tiny runs: a second or two of training each.
TINY = ["--num_actors", "1", "--unroll_length", "20", "--batch_size", "4",
        "--log_interval_steps", "500"]
NULL = null_env.ENV_ID  # a second environment, one that costs nothing to step


def table_rows(report, env):
    """The data rows of env's table in a report, as lists of cells."""
    section = report.split(f"## {env}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def cell(row, column):
    return row[learn.TABLE_HEADER.index(column)]


# ---------------------------------------------------------------------------------------------
# The launcher, end to end.

@pytest.mark.slow
def test_grid_runs_then_skips_and_reports(tmp_path, capsys):
    """2 envs x monobeast x 2 seeds: every run finishes, keeps its output in its folder, and
    a second launch skips them all; the report has a row per variant with both seeds and a
    PNG per env. Null-v0 gets per-env flags (shorter episodes finish within 2000 steps)."""
    savedir, output = tmp_path / "runs", tmp_path / "report.md"
    argv = ["--envs", f"CartPole-v1,{NULL}", "--variants", "monobeast", "--seeds", "0,1",
            "--total_steps", "2000", "--savedir", str(savedir), "--output", str(output),
            "--parallel", "2", "--env_args", f"{NULL}=--envs_per_actor 2",
            "--test_episodes", "2", "--", *TINY]
    first = subprocess.run([sys.executable, "-m", "bench.learn", *argv], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(re.findall(r"\] start \d/4 ", first.stderr)) == 4, first.stderr
    assert len(re.findall(r"\] done \d/4 ", first.stderr)) == 4, first.stderr
    # Each run's checkpoint is played twice: sampled actions, then greedy ones.
    assert len(re.findall(r"\] test \d/8 ", first.stderr)) == 8, first.stderr
    for xpid in ("CartPole-v1-monobeast-s0", "CartPole-v1-monobeast-s1",
                 f"{NULL}-monobeast-s0", f"{NULL}-monobeast-s1"):
        for name in ("logs.csv", "stdout.txt", "stderr.txt", "launch.json", "model.tar"):
            assert (savedir / xpid / name).is_file(), f"{xpid}/{name}"
    assert "--envs_per_actor 2" in (savedir / f"{NULL}-monobeast-s0" / "stderr.txt").read_text()

    assert learn.main(argv) == 0  # again, in this process: nothing left to run or test
    err = capsys.readouterr().err
    assert len(re.findall(r"\] skip \d/4 ", err)) == 4 and "] test " not in err, err
    banners = (savedir / "CartPole-v1-monobeast-s0" / "stderr.txt").read_text().count("=== ")
    assert banners == 1, "a finished run was launched again"

    report = output.read_text()
    for env in ("CartPole-v1", NULL):
        (row,) = table_rows(report, env)
        assert cell(row, "variant") == "monobeast"
        assert cell(row, "seeds finished") == "2/2"
        assert cell(row, "failures") == "0"
        assert cell(row, "steps reached").endswith("of 2,000")
        assert cell(row, "final return (mean ± std)") != "n/a"
        for column in learn.TEST_POLICIES.values():
            assert cell(row, column).endswith("(2 seeds x 2 episodes)")
        test = learn.read_curve(str(savedir / f"{env}-monobeast-s0"))
        for policy in ("sample", "greedy"):
            assert len(test.test_returns[policy]) == 2 and test.test_steps[policy] >= 2000
        png = tmp_path / "plots" / f"{env}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{env}.png)" in report


@pytest.mark.slow
def test_failing_runs_are_reported_not_fatal(tmp_path):
    """A bad flag and an unknown env: both runs fail, the second still runs, and the report
    and launch.json record each exit with the end of its stderr."""
    savedir, output = tmp_path / "runs", tmp_path / "report.md"
    code = learn.main(["--envs", "CartPole-v1,NoSuchEnv-v0", "--variants", "monobeast",
                       "--seeds", "0", "--total_steps", "2000", "--savedir", str(savedir),
                       "--output", str(output), "--parallel", "1",
                       "--env_args", "CartPole-v1=--no_such_flag", "--", *TINY])
    assert code == 1
    report = output.read_text()
    for env in ("CartPole-v1", "NoSuchEnv-v0"):
        (row,) = table_rows(report, env)
        assert cell(row, "failures") == "1" and cell(row, "seeds finished") == "0/1"
        assert (tmp_path / "plots" / f"{env}.png").is_file()
    assert "unrecognized arguments: --no_such_flag" in report
    record = json.loads((savedir / "CartPole-v1-monobeast-s0" / "launch.json").read_text())
    assert record["status"] == "failed" and record["returncode"] == 2
    assert "--no_such_flag" in record["error"]
    record = json.loads((savedir / "NoSuchEnv-v0-monobeast-s0" / "launch.json").read_text())
    assert record["status"] == "failed" and "NoSuchEnv" in record["error"]


def _wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kill_run(run_dir):
    try:
        os.killpg(json.loads((run_dir / "launch.json").read_text())["pid"], signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_ctrl_c_stops_the_runs_and_the_next_launch_resumes(tmp_path):
    """Ctrl-C on the launcher: its child checkpoints and exits, its process group is gone and
    the run is recorded as stopped. Launching again continues from the checkpoint.

    The launcher starts with SIGINT ignored, as a background job of a script (or of a pytest
    run in one) inherits it: it must still stop on SIGINT."""
    savedir = tmp_path / "runs"
    run_dir = savedir / "CartPole-v1-monobeast-s0"
    grid = ["--envs", "CartPole-v1", "--variants", "monobeast", "--seeds", "0",
            "--savedir", str(savedir), "--parallel", "1", "--stop_timeout_s", "30"]
    launcher = subprocess.Popen([sys.executable, "-m", "bench.launch", *grid, "--total_steps",
                                 str(10**9), "--", *TINY], cwd=REPO, stderr=subprocess.PIPE,
                                text=True, preexec_fn=ignore_sigint)
    try:
        # Once a row is logged the run is training, with its signal handlers in place.
        _wait_for(lambda: launch.logged_steps(str(run_dir)) > 0, 60, "the first logs.csv row")
        pid = json.loads((run_dir / "launch.json").read_text())["pid"]
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            kill_run(run_dir)  # a failed test leaves no training behind for the next ones
    assert launcher.returncode == 130, err
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no process of the run's session is left
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["status"] == "stopped", record
    stopped_at = int(re.search(r"Trained to step (\d+)", (run_dir / "stderr.txt").read_text())[1])

    total = stopped_at + 1000
    result = subprocess.run([sys.executable, "-m", "bench.launch", *grid, "--total_steps",
                             str(total), "--", *TINY], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resume from its checkpoint" in result.stderr
    assert launch.logged_steps(str(run_dir)) >= total
    resumed = (run_dir / "stderr.txt").read_text().split("=== ")[-1]
    assert "Trained to step" in resumed and "| done |" in result.stdout


def test_stop_at_steps_ends_a_run_early_on_its_long_schedule_and_a_larger_value_resumes(
        tmp_path):
    """A run stopped at --stop_at_steps is done there, checkpointed, with the learning-rate
    schedule of its --total_steps; a launch with the same value skips it, a larger one resumes
    it to that step."""
    savedir = tmp_path / "runs"
    run_dir = savedir / "CartPole-v1-monobeast-s0"
    grid = ["--envs", "CartPole-v1", "--variants", "monobeast", "--seeds", "0",
            "--savedir", str(savedir), "--total_steps", "10000000"]

    def launch_until(stop_at):
        result = subprocess.run([sys.executable, "-m", "bench.launch", *grid, "--stop_at_steps",
                                 str(stop_at), "--", *TINY], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = runlog.read_logs(run_dir / "logs.csv")
        # Stopped past it and far short of the total. The launcher reads the logs every
        # LOOK_EVERY_S, so how far past depends on the machine's speed: a loaded one runs CartPole
        # tens of thousands of steps past the mark before its SIGTERM lands.
        assert stop_at <= rows[-1]["step"] < 1_000_000
        return result, rows

    result, rows = launch_until(2000)
    assert "| done |" in result.stdout, result.stdout
    result, _ = launch_until(2000)
    assert "] skip 1/1 " in result.stderr and "| skipped |" in result.stdout
    result, rows = launch_until(int(rows[-1]["step"]) + 5000)
    assert "resume from its checkpoint" in result.stderr and "| done |" in result.stdout
    assert json.loads((run_dir / "flags.json").read_text())["total_steps"] == 10_000_000
    # The schedule is the ten million steps', not one that ends where the
    # run stopped, where the rate would be near 0.
    learning_rate = json.loads((run_dir / "flags.json").read_text())["learning_rate"]
    assert rows[-1]["learning_rate"] > 0.02 * learning_rate
    stderr = (run_dir / "stderr.txt").read_text()
    assert stderr.count("=== ") == 2  # the launch that skipped started nothing
    assert json.loads((run_dir / "launch.json").read_text())["status"] == "done"


def test_a_run_whose_logs_reach_total_steps_is_skipped_without_launching(tmp_path):
    spec = launch.RunSpec("CartPole-v1", "monobeast", 0, total_steps=100)
    write_logs(tmp_path / spec.xpid, [(1.0, 50, 1.0), (2.0, 100, 2.0)])
    (result,) = launch.run_grid([spec], tmp_path)
    assert result.status == "skipped" and result.steps == 100
    assert not (tmp_path / spec.xpid / "stdout.txt").exists()
    # A stop_at_steps past the total ends the run at the total, as the run itself does.
    assert launch.is_done(dataclasses.replace(spec, stop_at_steps=10**9), str(tmp_path))
    # Without a total_steps of its own the run's flags.json decides.
    spec = launch.RunSpec("CartPole-v1", "monobeast", 0)
    assert not launch.is_done(spec, str(tmp_path))  # not known yet: run it
    (tmp_path / spec.xpid / "flags.json").write_text(json.dumps({"total_steps": 100}))
    assert launch.is_done(spec, str(tmp_path))


def test_grid_flags_make_the_commands_and_report_every_problem():
    parser = learn.make_parser()
    args = launch.parse_args(parser, [
        "--envs", "CartPole-v1,MinAtar/Breakout-v1", "--variants", "monobeast", "--seeds",
        "3", "--env_args", "MinAtar/Breakout-v1=--num_actors 2 --use_lstm", "--", "--lr_x"])
    specs = learn.suite_grid(args)
    assert [s.xpid for s in specs] == ["CartPole-v1-monobeast-s3",
                                       "MinAtar-Breakout-v1-monobeast-s3"]
    assert specs[0].total_steps is None  # the repo's default for CartPole
    assert specs[1].total_steps == learn.MINATAR_STEPS
    command = specs[1].command("/runs")
    assert command[1:] == ["-m", "monobeast", "--env", "MinAtar/Breakout-v1", "--seed", "3",
                           "--xpid", "MinAtar-Breakout-v1-monobeast-s3", "--savedir", "/runs",
                           "--no_progress", "--total_steps", "5000000", "--lr_x",
                           "--num_actors", "2", "--use_lstm"]
    bad = parser.parse_args(["--variants", "tribeast", "--seeds", "a", "--parallel", "0",
                             "--env_args", "Pong=--x", "--test_episodes", "-1"])
    problems = launch.grid_problems(bad)
    assert len(problems) == 5, problems
    past = parser.parse_args(["--total_steps", "1000", "--stop_at_steps", "2000"])
    assert launch.grid_problems(past) == [
        "--stop_at_steps (2000) is past --total_steps (1000), where the runs end anyway."]
    assert launch.grid_problems(parser.parse_args(["--stop_at_steps", "0"])) == [
        "--stop_at_steps must be positive (got 0)."]
    with pytest.raises(ValueError, match="ENV=ARGS"):
        launch.parse_env_args(["--num_actors 2"])


# ---------------------------------------------------------------------------------------------
# Aggregation, on hand-made logs.

def write_logs(path, rows, header=("_time", "step", "mean_episode_return")):
    os.makedirs(path, exist_ok=True)
    lines = [",".join(header)] + [",".join("" if v is None else str(v) for v in row)
                                  for row in rows]
    (path / "logs.csv").write_text("\n".join(lines) + "\n")
    return path


def test_read_curve_final_eval_superseded_rows_and_wall_time(tmp_path):
    """The final return comes from the last row with one (an evaluation row has none); rows a
    resume made stale are dropped; the wall time runs from each start to its last row."""
    header = ("_time", "step", "mean_episode_return", "eval_mean_episode_return")
    run = write_logs(tmp_path / "run", [
        (100.0, 10, "nan", None),  # no episode has ended yet
        (110.0, 20, 5.0, None),
        (120.0, 30, 7.0, None),  # stale: the resume went back to the checkpoint of step 20
        (120.5, 30, None, 50.0),
        (500.0, 20, 6.0, None),  # the second start
        (510.0, 40, 9.0, None),
        (511.0, 40, None, 60.0),
    ], header)
    (run / "meta.json.1").write_text(json.dumps({"start_unix": 95.0}))
    (run / "meta.json").write_text(json.dumps({"start_unix": 490.0}))
    curve = learn.read_curve(str(run))
    assert curve.steps == [20, 40] and curve.returns == [6.0, 9.0]
    assert curve.final_return == 9.0 and curve.eval_return == 60.0 and curve.last_step == 40
    assert curve.wall_s == pytest.approx((120.5 - 95.0) + (511.0 - 490.0))
    # Evaluation rows come when their evaluation ends, at their snapshot's step, possibly
    # after training rows of later steps: they do not look like a resume.
    late = write_logs(tmp_path / "late", [
        (1.0, 10, 3.0, None), (2.0, 20, 5.0, None), (3.0, 30, 8.0, None),
        (4.0, 10, None, 40.0), (5.0, 20, None, 70.0)], header)
    curve = learn.read_curve(str(late))
    assert curve.steps == [10, 20, 30] and curve.final_return == 8.0
    assert curve.eval_return == 70.0 and curve.last_step == 30
    assert curve.eval_steps == [10, 20] and curve.eval_returns == [40.0, 70.0]
    # Without meta.json the first row stands for the start, and nothing is stale.
    os.remove(run / "meta.json")
    os.remove(run / "meta.json.1")
    assert learn.read_curve(str(run)).wall_s == pytest.approx(511.0 - 100.0)
    assert learn.read_curve(str(tmp_path / "nothing")) is None


def test_compare_reports_another_savedirs_runs_beside_these(tmp_path, capsys):
    """--compare LABEL=SAVEDIR: the same grid read from a second savedir, in the same table
    and figure as rows named 'VARIANT, LABEL'; nothing is launched there. A malformed item or
    a savedir that is not there is refused before anything runs."""
    finals = {"a": (10.0, 20.0), "b": (30.0, 50.0)}
    for label, (f0, f1) in finals.items():
        for seed, final in enumerate((f0, f1)):
            write_logs(tmp_path / label / f"Null-v0-monobeast-s{seed}",
                       [(1.0, 500, 1.0), (2.0, 1000, final)])
    output = tmp_path / "report.md"
    argv = ["--envs", "Null-v0", "--variants", "monobeast", "--seeds", "0,1",
            "--total_steps", "1000", "--savedir", str(tmp_path / "a"), "--label", "first",
            "--compare", f"second={tmp_path / 'b'}", "--no_launch", "--output", str(output)]
    assert learn.main(argv) == 0
    report = output.read_text()
    rows = {cell(row, "variant"): row for row in table_rows(report, "Null-v0")}
    assert list(rows) == ["monobeast, first", "monobeast, second"]
    assert cell(rows["monobeast, first"], "final return (mean ± std)").startswith("15.00 ± ")
    assert cell(rows["monobeast, second"], "final return (mean ± std)").startswith("40.00 ± ")
    assert cell(rows["monobeast, second"], "seeds finished") == "2/2"
    assert str(tmp_path / "b") in report.splitlines()[2]
    assert (tmp_path / "plots" / "Null-v0.png").is_file()
    assert not (tmp_path / "b" / "Null-v0-monobeast-s0" / "launch.json").exists()
    for bad, says in ((["--compare", "nolabel"], "expected LABEL=SAVEDIR"),
                      (["--compare", f"x={tmp_path / 'nowhere'}"], "no such savedir"),
                      (["--compare", f"first={tmp_path / 'b'}"], "a different label each")):
        with pytest.raises(SystemExit):
            learn.main(argv[:-2] + bad)
        assert says in capsys.readouterr().err


def test_spread_over_seeds():
    s = learn.spread([1.0, 2.0, 3.0, math.nan])  # a seed without a finished episode
    assert (s.n, s.mean, s.std, s.lo, s.hi) == (3, 2.0, 1.0, 1.0, 3.0)  # sample std (n-1)
    one = learn.spread([4.0])
    assert one.n == 1 and one.mean == 4.0 and math.isnan(one.std)
    assert learn.spread([]).n == 0
    assert learn.fmt_spread(s) == "2.0 ± 1.0" and learn.fmt_range(s) == "1.0 – 3.0"


def test_band_interpolates_on_the_steps_all_seeds_cover(tmp_path):
    a = learn.read_curve(str(write_logs(tmp_path / "a", [(1, 100, 0), (2, 200, 10), (3, 300, 20)])))
    b = learn.read_curve(str(write_logs(tmp_path / "b", [(1, 150, 5), (2, 250, 5), (3, 350, 5)])))
    grid, mean, lo, hi = learn.band([a, b], points=4)
    np.testing.assert_allclose(grid, [150, 200, 250, 300])
    # a at 150, 200, 250, 300: 5, 10, 15, 20 (linear between its points); b is 5 throughout.
    np.testing.assert_allclose(mean, [5, 7.5, 10, 12.5])
    np.testing.assert_allclose(lo, [5, 5, 5, 5])
    np.testing.assert_allclose(hi, [5, 10, 15, 20])
    c = learn.read_curve(str(write_logs(tmp_path / "c", [(1, 400, 1), (2, 500, 2)])))
    assert len(learn.common_grid([a, c])) == 0  # no step that both cover
    assert len(learn.band([a, None], points=4)[0]) == 4  # a seed without logs is left out


def test_table_row_counts_finished_seeds_and_failures():
    spec = launch.RunSpec("CartPole-v1", "monobeast", 0, total_steps=100)
    results = [launch.RunResult(spec, "done", steps=100, target=100),
               launch.RunResult(spec, "skipped", steps=120, target=100),
               launch.RunResult(spec, "failed", error="exit status 2", target=100)]
    curves = [learn.Curve([50, 100], [1.0, 3.0], 100, 10.0),
              learn.Curve([50, 120], [2.0, 5.0], 120, 20.0), None]
    row = learn.table_row("monobeast", results, curves, None)
    assert cell(row, "final return (mean ± std)") == "4.00 ± 1.41 (2 seeds)"
    assert cell(row, "min – max") == "3.00 – 5.00"
    assert cell(row, "seeds finished") == "2/3" and cell(row, "failures") == "1"
    assert cell(row, "steps reached") == "100 – 120 of 100"
    assert cell(row, "wall time per run") == "15.0 s" and cell(row, "eval return") == "n/a"
    assert cell(row, "SPS") == "8"  # the mean of 100 / 10 and 120 / 20
    assert cell(row, "collapses") == "0"
    assert cell(row, "steps to solved (median)") == "—"  # no threshold given


def test_steps_to_solved_by_training_curve_and_by_evaluation():
    k = 100_000
    spec = launch.RunSpec("CartPole-v1", "monobeast", 0, total_steps=4 * k)
    results = [launch.RunResult(spec, "done", steps=4 * k, target=4 * k)] * 3
    steps = [k, 2 * k, 3 * k, 4 * k]
    curves = [learn.Curve(steps, [10.0, 480.0, 300.0, 490.0], 4 * k, 1.0,
                          eval_steps=[k, 2 * k], eval_returns=[476.0, 500.0]),
              learn.Curve(steps, [10.0, 20.0, 30.0, 475.0], 4 * k, 1.0,
                          eval_steps=[k, 3 * k], eval_returns=[20.0, 475.0]),
              learn.Curve(steps[:2], [1.0, 2.0], 2 * k, 1.0)]  # never solved, no evaluations
    row = learn.table_row("monobeast", results, curves, None, threshold=475)
    # Training: 0.2M and 0.4M (2 of 3 seeds); evaluation: 0.1M and 0.3M (both that evaluated).
    assert cell(row, "steps to solved (median)") == (
        "training 0.30M (2/3), evaluation 0.20M (2/2)")
    assert curves[0].first_at(475) == 2 * k and curves[1].first_at(475) == 4 * k
    assert curves[0].first_at(475, evaluation=True) == k
    assert curves[1].first_at(475, evaluation=True) == 3 * k
    assert curves[2].first_at(475) is None
    evaluated = learn.evaluation_curves(curves)  # the third run never evaluated
    assert [(c.steps, c.returns) for c in evaluated] == [
        ([k, 2 * k], [476.0, 500.0]), ([k, 3 * k], [20.0, 475.0])]


def curve(returns, every=1):
    """A Curve with a point every `every` steps from `every` on."""
    steps = [every * i for i in range(1, len(returns) + 1)]
    return learn.Curve(steps, list(returns), every * len(returns), 1.0)


def test_collapse_is_a_fall_below_half_the_gain_over_the_start():
    # Start 1, best 17: a gain of 16, half of it lost below 9. 9 is not below, 8.8 is (and
    # is above 17 / 2, where halving from zero would put it).
    assert curve([1, 12, 17, 9, 8.8, 15, 20]).collapse() == (5, 17, 8.8)
    # Start 10, best 16: the line is at 13.
    assert curve([10, 16, 12.9, 14, 16]).collapse() == (3, 16, 12.9)
    assert curve([10, 16, 13.1, 14, 16]).collapse() is None
    # A dip before the best's gain is a tenth of the run's largest (50): the noise of a curve
    # that has barely moved. At exactly a tenth it counts.
    assert curve([0, 4, 1, 20, 50]).collapse() is None
    assert curve([0, 5, 1, 20, 50]).collapse() == (3, 5, 1)
    assert curve([4, 1, 6, 12, 18, 20]).collapse() is None  # below its start: nothing gained
    # Negative returns fall as positive ones do (Acrobot: -100 is a gain of 400 over -500).
    assert curve([-500, -100, -400, -90]).collapse() == (3, -100, -400)
    # A curve that never rises above its start, a single point, no point: no fall.
    assert curve([5, 4, 1, 3]).collapse() is None
    assert curve([7]).collapse() is None and curve([]).collapse() is None


def test_an_early_dip_is_a_fall_though_the_curve_ends_far_above_it():
    """MinAtar Breakout: the 100-episode mean rises to 15.2, drops to 3.0 and ends at 73.
    Halving the best only once past half of the final value never saw the dip."""
    breakout = curve([0.5, 8, 15.2, 3.0, 12, 30, 50, 73], every=100_000)
    assert breakout.falls() == [(400_000, 15.2, 3.0)]
    assert breakout.collapse() == (400_000, 15.2, 3.0)


def test_a_negative_return_curve_falls_when_it_loses_half_its_gain():
    """Pong starts near -21: from -20.5 to -5 is a gain of 15.5, and -16 leaves 4.5 of it,
    below half; -12 would leave 8.5, above half."""
    assert curve([-20.5, -15, -5, -16, 0, 10]).falls() == [(4, -5, -16)]
    assert curve([-20.5, -15, -5, -12, 0, 10]).falls() == []


def test_a_curve_that_has_not_moved_has_no_falls():
    """Pong before it starts wobbles by a few tenths around -20.5: its largest gain (0.4) is
    below a tenth of its start's size, so no wobble is a fall; a curve starting at 0 that
    gains anything can fall."""
    assert curve([-20.5, -20.1, -20.9, -20.2, -20.8]).falls() == []
    assert curve([0, 0.4, 0.1, 0.5]).falls() == [(3, 0.4, 0.1)]


def test_falls_are_counted_again_only_after_a_recovery_to_90_percent_of_the_gain():
    # Start 1, best 17 (gain 16): falls to 8, back to 16 (gain 15, over 14.4), falls to 7.
    assert curve([1, 12, 17, 8, 16, 7, 20]).falls() == [(4, 17, 8), (6, 17, 7)]
    # Back only to 15.35 (gain 14.35, under 14.4, though over 90% of 17): one fall.
    assert curve([1, 12, 17, 8, 15.35, 7, 20]).falls() == [(4, 17, 8)]
    # From -20 to 0 (gain 20): back at -1 is 19 of it (over 18), at -3 only 17 (under).
    assert curve([-20, 0, -15, -1, -16, 10]).falls() == [(3, 0, -15), (5, 0, -16)]
    assert curve([-20, 0, -15, -3, -16, 10]).falls() == [(3, 0, -15)]
    assert curve([4, 1, 6, 12, 18, 20]).falls() == []


def test_falls_pass_over_the_dip_after_a_resume_but_not_a_fall_that_lasts(tmp_path):
    """A resume starts every environment afresh and the short episodes end first: the mean
    dips until num_envs + 100 episodes have ended (4 x 8 + 100 = 132 here). A dip inside that
    is no fall; one that lasts beyond it is, found in the rows after."""
    header = ("_time", "step", "mean_episode_return", "episodes")
    first = [(10.0 + i, 10 * i, r, 40 * i) for i, r in enumerate([2, 12, 16, 18, 20], 1)]
    resumed = [(100.0, 60, 9.0, 230), (101.0, 70, 8.0, 300),  # 200 + 32 + 100 = 332 settles
               (102.0, 80, 19.0, 340), (103.0, 90, 21.0, 400)]
    lasting = [(100.0, 60, 9.0, 230), (101.0, 70, 8.0, 300), (102.0, 80, 7.0, 340),
               (103.0, 90, 21.0, 400)]
    for name, rows in ("dip", first + resumed), ("fall", first + lasting):
        run = write_logs(tmp_path / name, rows, header)
        (run / "meta.json.1").write_text(json.dumps({"start_unix": 5.0}))
        (run / "meta.json").write_text(json.dumps({"start_unix": 99.0}))
        (run / "flags.json").write_text(json.dumps({"num_actors": 4, "envs_per_stream": 8}))
    dip = learn.read_curve(str(tmp_path / "dip"))
    assert dip.settling == [(60, 80)]
    assert dip.falls() == []
    assert learn.read_curve(str(tmp_path / "fall")).falls() == [(80, 20.0, 7.0)]
    # Without the resume's start time, or without the episodes column, nothing settles.
    os.remove(tmp_path / "dip" / "meta.json")
    assert learn.read_curve(str(tmp_path / "dip")).falls() == [(60, 20.0, 9.0)]
    assert learn.resume_settling([{"_time": 1.0, "step": 10.0}, {"_time": 3.0, "step": 20.0}],
                                 [0.0, 2.0], 8) == []
    # An evaluation row written after the resume carries an older snapshot's step: the
    # window starts at the first training row.
    rows = [{"_time": 1.0, "step": 10.0, "episodes": 5.0},
            {"_time": 3.0, "step": 4.0, "eval_mean_episode_return": 1.0},
            {"_time": 4.0, "step": 12.0, "episodes": 6.0},
            {"_time": 5.0, "step": 14.0, "episodes": 110.0}]
    assert learn.resume_settling(rows, [0.0, 2.0], 0) == [(12.0, 14.0)]  # 5 + 0 + 100
    assert learn.resume_settling(rows, [0.0, 2.0], 8) == [(12.0, math.inf)]  # not yet


def test_table_row_names_the_seeds_that_collapsed():
    spec = launch.RunSpec("MinAtar/Breakout-v1", "monobeast", 0, total_steps=700_000)
    results = [launch.RunResult(spec, "done", steps=700_000, target=700_000)] * 4
    k = 100_000
    curves = [curve([1, 12, 17, 8, 16, 7, 20], k),  # two falls
              curve([4, 1, 6, 12, 18, 20, 20], k),  # none: its dip is below its start
              curve([0.5, 8, 15.2, 3.0, 12, 30, 73], k),  # an early dip
              curve([-20.5, -15, -5, -16, 0, 10, 10], k)]  # negative returns
    row = learn.table_row("monobeast", results, curves, None)
    assert cell(row, "collapses") == (
        "3 (17.0 to 8.0 at 0.40M, 15.2 to 3.0 at 0.40M, -5.0 to -16.0 at 0.40M)")
    assert cell(row, "falls") == "4, 1.0 a run (3 of 4 seeds)"


def test_turned_deterministic_counts_each_time_the_entropy_falls_below_the_threshold():
    # Below 0.01 at step 3 (return 12) and, after the entropy is back above 0.05, at step 6.
    # The dip to 0.008 at step 4 is the same collapse: the entropy never went back up.
    c = learn.Curve([1, 2, 3, 4, 5, 6, 7], [5, 20, 12, 2, 15, 9, 25], 7, 1.0,
                    entropy_steps=[1, 2, 3, 4, 5, 6, 7],
                    entropies=[0.9, 0.3, 0.004, 0.008, 0.2, 1e-9, 0.3])
    assert c.deterministic() == [(3, 12), (6, 9)]
    healthy = dataclasses.replace(c, entropies=[0.9, 0.3, 0.05, 0.02, 0.2, 0.03, 0.3])
    assert healthy.deterministic() == []
    spec = launch.RunSpec("MinAtar/SpaceInvaders-v1", "polybeast", 0, total_steps=7)
    results = [launch.RunResult(spec, "done", steps=7, target=7)] * 3
    row = learn.table_row("polybeast", results, [c, healthy, curve([1, 2])], None)
    # The run without entropies (curve()) is left out of the count.
    assert cell(row, "turned deterministic") == (
        "1 of 2 seeds: 0.00M (return 12.0), 0.00M (return 9.0)")
    assert cell(learn.table_row("polybeast", results[:1], [curve([1, 2])], None),
                "turned deterministic") == "—"


def test_read_curve_takes_the_entropy_from_its_column_or_from_the_entropy_term(tmp_path):
    header = ("_time", "step", "mean_episode_return", "entropy_loss", "policy_entropy")
    run = write_logs(tmp_path / "new", [(1.0, 10, 3.0, -3.2, 0.5), (2.0, 20, 4.0, -1.6, 0.25)],
                     header)
    curve = learn.read_curve(str(run))
    assert curve.entropy_steps == [10, 20] and curve.entropies == [0.5, 0.25]
    # A run from before the column: entropy_loss = -entropy_cost x the entropy summed over
    # T x B, read back with its flags.json.
    old = write_logs(tmp_path / "old", [(1.0, 10, 3.0, -3.2), (2.0, 20, 4.0, -0.0016)],
                     header[:4])
    (old / "flags.json").write_text(json.dumps(
        dict(entropy_cost=0.01, unroll_length=20, batch_size=16)))
    curve = learn.read_curve(str(old))
    assert curve.entropies == pytest.approx([1.0, 0.0005])
    assert curve.deterministic() == [(20, 4.0)]
    # Resumed across the column: each row from where it has it.
    resumed = write_logs(tmp_path / "resumed", [(1.0, 10, 3.0, -3.2, None),
                                                (2.0, 20, 4.0, -0.0016, 0.7)], header)
    (resumed / "flags.json.1").write_text((old / "flags.json").read_text())  # the first start
    (resumed / "flags.json").write_text(json.dumps(
        dict(entropy_cost=0.01, unroll_length=20, batch_size=16, pg_clip=0.0)))
    assert learn.read_curve(str(resumed)).entropies == pytest.approx([1.0, 0.7])
    (old / "flags.json").write_text(json.dumps(
        dict(entropy_cost=0.0, unroll_length=20, batch_size=16)))
    assert learn.read_curve(str(old)).entropies == []  # no entropy term, nothing to read
    # A run begun with the column that writes none has a Gaussian policy: its entropy term is
    # not a softmax's, and nothing is read from it.
    (old / "flags.json").write_text(json.dumps(
        dict(entropy_cost=0.01, unroll_length=20, batch_size=16, pg_clip=0.0)))
    assert learn.read_curve(str(old)).entropies == []


def test_trust_region_cut_is_the_mean_over_seeds_of_each_seeds_median(tmp_path):
    header = ("_time", "step", "mean_episode_return", "pg_clipped")
    # The median of 0.01, 0.03 and 0.5 is 0.03: one odd row does not move it, as a mean would.
    wide = write_logs(tmp_path / "wide", [(1.0, 10, 1.0, 0.01), (2.0, 20, 2.0, 0.5),
                                          (3.0, 30, 3.0, 0.03)], header)
    # Rows without the column (a start before it, an evaluation row) are passed over.
    narrow = write_logs(tmp_path / "narrow", [(1.0, 10, 1.0, None), (2.0, 20, 2.0, 0.01)],
                        header)
    curves = [learn.read_curve(str(wide)), learn.read_curve(str(narrow))]
    assert curves[0].pg_clipped == [0.01, 0.5, 0.03] and curves[1].pg_clipped == [0.01]
    spec = launch.RunSpec("MinAtar/Breakout-v1", "polybeast", 0, total_steps=30)
    results = [launch.RunResult(spec, "done", steps=30, target=30)] * 3
    row = learn.table_row("polybeast", results, curves + [curve([1, 2])], None)
    # Seeds without the column (no --pg_clip) are left out of the mean and the count.
    assert cell(row, "trust region cut (median)") == "2.0% (1.0% – 3.0%, 2 seeds)"
    assert cell(learn.table_row("polybeast", results[:1], [curve([1, 2])], None),
                "trust region cut (median)") == "—"


def test_welch_matches_scipys_unequal_variance_t_test():
    stats = pytest.importorskip("scipy.stats")
    for a, b in (([1, 2, 3.5], [0.5, 0.7, 3]), ([217, 183, 172, 283, 250, 199, 230, 201],
                                               [125, 250, 170, 160, 190, 180, 150, 182])):
        diff, t, df = learn.welch(a, b)
        reference = stats.ttest_ind(a, b, equal_var=False)
        assert diff == pytest.approx(np.mean(a) - np.mean(b))
        assert t == pytest.approx(reference.statistic) and df == pytest.approx(reference.df)
    # nan (a seed without a return) is left out; one value or no spread gives no t.
    assert learn.welch([1, 2, math.nan], [0.5, 0.7, 3])[1] == pytest.approx(
        stats.ttest_ind([1, 2], [0.5, 0.7, 3], equal_var=False).statistic)
    assert math.isnan(learn.welch([1], [2, 3])[1]) and math.isnan(learn.welch([1, 1], [2, 2])[1])


def test_report_gives_each_row_against_the_first_seed_for_seed():
    first = {0: curve([1, 10]), 1: curve([1, 20]), 2: curve([1, 30])}
    # Seed 2 is higher, seeds 0 and 1 lower; seed 3 has no partner in the first row.
    second = {0: curve([1, 8]), 1: curve([1, 14]), 2: curve([1, 35]), 3: curve([1, 5])}
    second[0].test_returns = {"greedy": [1.0]}  # only one side tested: no test-return part
    lines = learn.difference_lines(["a", "b, other"], {"a": first, "b, other": second})
    t = learn.welch([8, 14, 35, 5], [10, 20, 30])[1]
    final = (f"final return -4.50 (Welch t {t:.1f}, "
             f"{learn.welch([8, 14, 35, 5], [10, 20, 30])[2]:.1f} df; "
             "higher in 1 of 3 seeds, seed for seed)")
    assert lines[0] == "Against `a` (the first row):"
    assert lines[1] == f"- `b, other`: {final}"
    assert learn.difference_lines(["a"], {"a": first}) == []
    # Both sides tested: the checkpoint's sampled and greedy returns are set side by side too,
    # each from its own policy's returns.
    for seed, (sampled, greedy) in enumerate([(2.0, 9.0), (4.0, 9.5), (6.0, 10.0)]):
        first[seed].test_returns = {"sample": [sampled], "greedy": [greedy]}
        second[seed].test_returns = {"sample": [sampled + 1], "greedy": [greedy - 2 * seed]}
    lines = learn.difference_lines(["a", "b, other"], {"a": first, "b, other": second})
    sampled = learn.welch([3, 5, 7], [2, 4, 6])
    greedy = learn.welch([9, 7.5, 6], [9, 9.5, 10])
    assert lines[1] == (f"- `b, other`: {final}; checkpoint sampled return +1.00 "
                        f"(Welch t {sampled[1]:.1f}, {sampled[2]:.1f} df; higher in 3 of 3 "
                        f"seeds, seed for seed); checkpoint greedy return -2.00 (Welch t "
                        f"{greedy[1]:.1f}, {greedy[2]:.1f} df; higher in 0 of 3 seeds, seed "
                        "for seed)")


def test_two_rank_variant_starts_polybeast_under_torchrun():
    spec = launch.RunSpec("CartPole-v1", "polybeast-2ranks", 3, total_steps=1000)
    command = spec.command("/runs")
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m"]
    assert command[6] == "polybeast" and "--total_steps" in command
    assert spec.xpid == "CartPole-v1-polybeast-2ranks-s3"
    # Its test plays on one process: --mode test refuses torchrun.
    assert learn.test_command(spec, "/runs", 5, "sample")[1:] == [
        "-m", "polybeast", "--mode", "test", "--savedir", "/runs", "--xpid", spec.xpid,
        "--test_episodes", "5", "--eval_policy", "sample"]


def test_a_run_is_tested_again_only_for_a_later_checkpoint_or_more_episodes(tmp_path):
    """Each policy on its own: a finished run needs a sampled and a greedy test of its final
    checkpoint with at least --test_episodes episodes each."""
    spec = launch.RunSpec("CartPole-v1", "monobeast", 0, total_steps=1000)
    path = launch.run_dir(spec, str(tmp_path))
    os.makedirs(path)
    done = launch.RunResult(spec, "done", steps=1000, target=1000)
    needs = lambda policy, episodes=5: learn.needs_test(done, str(tmp_path), episodes, policy)
    assert needs("sample") and needs("greedy")
    assert not needs("sample", 0) and not needs("greedy", 0)
    assert not learn.needs_test(launch.RunResult(spec, "stopped", steps=500, target=1000),
                                str(tmp_path), 5, "greedy")  # unfinished: not its final one
    tests = os.path.join(path, "tests.jsonl")
    runlog.record_test(tests, 500, "greedy", 1, [1.0] * 5)  # an earlier checkpoint
    runlog.record_test(tests, 1000, "sample", 1, [1.0] * 5)
    assert not needs("sample") and needs("sample", 6) and needs("greedy")
    runlog.record_test(tests, 1000, "greedy", 1, [1.0] * 5)
    runlog.record_test(tests, 1000, "greedy", 1, [2.0, 4.0, 6.0])  # fewer, but the latest
    assert not needs("greedy") and needs("greedy", 6)
    with open(tests, "a") as f:
        f.write('{"time": 1, "step": 10')  # a torn last line is left out
    curve = learn.read_curve(str(write_logs(tmp_path / spec.xpid, [(1.0, 1000, 3.0)])))
    # The report reads the latest test of each policy at the furthest checkpoint.
    assert curve.test_returns == {"sample": [1.0] * 5, "greedy": [2.0, 4.0, 6.0]}
    assert curve.test_return("greedy") == 4.0 and curve.test_return("sample") == 1.0
    assert curve.test_steps == {"sample": 1000, "greedy": 1000}


def test_checkpoint_columns_sit_beside_the_final_return_and_read_old_greedy_only_tests(
        tmp_path):
    """Runs tested before sampled tests existed have only greedy records: their sampled
    cell says n/a."""
    header = learn.TABLE_HEADER
    final = header.index("final return (mean ± std)")
    assert header[final + 1:final + 3] == ["checkpoint, sampled (mean ± std over seeds)",
                                           "checkpoint, greedy"]
    curves = []
    for seed, greedy in enumerate(([10.0, 20.0], [30.0, 40.0])):
        run = write_logs(tmp_path / f"s{seed}", [(1.0, 1000, 3.0)])
        runlog.record_test(str(run / "tests.jsonl"), 1000, "greedy", 1, greedy)
        curves.append(learn.read_curve(str(run)))
    spec = launch.RunSpec("CartPole-v1", "monobeast", 0, total_steps=1000)
    results = [launch.RunResult(spec, "done", steps=1000, target=1000)] * 3
    row = learn.table_row("monobeast", results, curves + [None], None)
    assert cell(row, "checkpoint, sampled (mean ± std over seeds)") == "n/a"
    assert cell(row, "checkpoint, greedy") == "25.00 ± 14.14 (2 seeds x 2 episodes)"
    curves[0].test_returns["sample"] = [1.0, 2.0, 3.0]
    row = learn.table_row("monobeast", results, curves, None)
    assert cell(row, "checkpoint, sampled (mean ± std over seeds)") == (
        "2.00 (1 seeds x 3 episodes)")
