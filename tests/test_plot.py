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


def test_time_axis_leaves_out_the_pause_before_a_resume():
    # Two starts: 100 s (rows at 110 and 130), then a pause, 500 s (rows at 505 and 520).
    times = [110.0, 130.0, 505.0, 520.0]
    assert runlog.training_seconds(times, [100.0, 500.0]) == [10.0, 30.0, 35.0, 50.0]
    # Without the starts the first row stands for the only start.
    assert runlog.training_seconds(times) == [0.0, 20.0, 395.0, 410.0]
    assert runlog.training_seconds([]) == []


def test_parse_reference():
    assert plot.parse_reference("CleanRL PPO@2.5M=18") == ("CleanRL PPO", 2.5e6, 18.0)
    assert plot.parse_reference("a@300=-20.5") == ("a", 300.0, -20.5)
    assert plot.parse_reference(" b @ 40k=1e1") == ("b", 40e3, 10.0)
    for bad in ("no at sign=3", "x@1G=2", "x@3", "@3=4"):
        with pytest.raises(ValueError, match="write LABEL@X=Y"):
            plot.parse_reference(bad)


def test_plot_draws_the_target_and_the_references(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "runs", "first", slope=1.0)
    drawn = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), [list(a) for a in args]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    plot.main([run.path, "-o", str(tmp_path / "r.png"), "--target", "18",
               "--reference", "peer A@1.5k=18", "--reference", "peer B@900=-3"])
    assert ("peer A", [[1500.0], [18.0]]) in drawn
    assert ("peer B", [[900.0], [-3.0]]) in drawn
    assert drawn[0][0] == "first" and drawn[0][1][1] == [float(i) for i in range(1, 20)]


def test_a_bad_reference_is_a_clear_error(tmp_path, capsys):
    run = fake_run(tmp_path / "runs", "first", slope=1.0)
    with pytest.raises(SystemExit) as info:
        plot.main([run.path, "-o", str(tmp_path / "x.png"), "--reference", "peer=18"])
    assert info.value.code == 2
    assert "write LABEL@X=Y" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
