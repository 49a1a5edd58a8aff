import math

import pytest

from beast import plot, runlog


def fake_run(savedir, xpid, slope):
    run_dir = runlog.RunDir(savedir, xpid)
    with runlog.StatsLogger(run_dir, use_tensorboard=False) as logger:
        logger.log(0, {"mean_episode_return": math.nan, "total_loss": 1.0})
        for i in range(1, 20):
            logger.log(i * 100, {"mean_episode_return": slope * i, "total_loss": 1.0 / i})
    return run_dir


def test_plot_two_runs(tmp_path):
    first = fake_run(tmp_path / "runs", "first", slope=1.0)
    second = fake_run(tmp_path / "runs", "second", slope=2.0)
    output = tmp_path / "returns.png"
    plot.main([first.path, second.path, "-o", str(output), "--smooth", "3"])
    with open(output, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert output.stat().st_size > 1000


def test_plot_parent_directory_and_time_axis(tmp_path):
    fake_run(tmp_path / "runs", "first", slope=1.0)
    fake_run(tmp_path / "runs", "second", slope=2.0)
    assert plot.find_runs([str(tmp_path / "runs")]) == [
        str(tmp_path / "runs" / "first"),
        str(tmp_path / "runs" / "second"),
    ]
    output = tmp_path / "time.png"
    plot.main([str(tmp_path / "runs"), "-o", str(output), "--x", "_time"])
    assert output.stat().st_size > 1000


def test_missing_logs_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        plot.main([str(tmp_path / "empty"), "-o", str(tmp_path / "x.png")])
    assert info.value.code == 2
    assert "no logs.csv in" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_smooth():
    assert plot.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot.smooth([1.0, 2.0], 1) == [1.0, 2.0]
