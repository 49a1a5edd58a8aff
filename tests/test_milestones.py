import csv
import json

import pytest

from bench import milestones


def write_run(path, rows, starts, tests=()):
    """A hand-made run directory: logs.csv rows (_time, step, return, length), one meta.json
    per start (the latest as meta.json, earlier ones as .1, .2 as a resume keeps them) and
    tests.jsonl records (policy, step, returns)."""
    path.mkdir()
    with open(path / "logs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["_time", "step", "mean_episode_return", "mean_episode_length"])
        writer.writerows(rows)
    names = ["meta.json"] + [f"meta.json.{i}" for i in range(1, len(starts))]
    for name, start in zip(names, reversed(starts)):
        (path / name).write_text(json.dumps({"start_unix": start}))
    with open(path / "tests.jsonl", "w") as f:
        for policy, step, returns in tests:
            f.write(json.dumps({"policy": policy, "step": step, "returns": returns}) + "\n")
    return str(path)


@pytest.fixture
def resumed_run(tmp_path):
    # Launched at 1000 s, stopped after its row at 1600; resumed at 5000 s. Seconds of
    # training at the rows: 60, 600, then 600 + 30 = 630 and 600 + 700 = 1300.
    rows = [(1060, 100, -20, 900), (1600, 1000, -5, 1500), (5030, 1100, 0, 2000),
            (5700, 2000, 18, 1800)]
    tests = [("sample", 2000, [1, 3]), ("greedy", 1000, [4, 4, 4])]
    return write_run(tmp_path / "run", rows, starts=[1000, 5000], tests=tests)


def test_returns_firsts_and_tests_of_a_resumed_run(resumed_run):
    m = milestones.milestones(resumed_run, minutes=[1, 10, 20, 22, 25], thresholds=[0, 18, 19])
    # 22 minutes (1320 s) lies within a minute of the run's end (1300 s); 25 does not.
    assert m["returns"] == {1: -20, 10: -5, 20: 0, 22: 18, 25: None}
    assert m["firsts"] == {0: (630, 1100), 18: (1300, 2000), 19: None}
    assert m["seconds"] == 1300 and m["steps"] == 2000 and m["length"] == 1800
    assert m["tests"]["sample"]["returns"] == [1, 3]


def test_table_rows(resumed_run, capsys):
    milestones.main([resumed_run, "--minutes", "10,25", "--thresholds=-10,18",
                     "--labels", "seed 0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | return at 10 / 25 minutes | first -10 | first +18 |")
    # SPS: 2000 steps over 1300 s. The greedy test is of an earlier checkpoint: marked.
    assert lines[2] == ("| seed 0 | -5.0 / - | 10 min, 0.00M | 22 min, 0.00M | 0.00M (2) "
                        "| 1,800 | +2.0 (2) | +4.0 (3) at 0.00M |")


def test_returns_at_steps(resumed_run, capsys):
    steps = [50, 100, 1099, 2000, 2001]
    m = milestones.milestones(resumed_run, minutes=[], thresholds=[], steps=steps)
    # Before the first row: nothing yet; past the last row's step: the run stopped short.
    assert m["at_steps"] == {50: None, 100: -20, 1099: -5, 2000: 18, 2001: None}
    milestones.main([resumed_run, "--minutes", "10", "--steps", "1e3,3e3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | return at 10 minutes | return at 0.001 / 0.003M steps |")
    assert lines[2].startswith("| run | -5.0 | -5.0 / - |")


def test_one_label_per_run(resumed_run, capsys):
    with pytest.raises(SystemExit) as info:
        milestones.main([resumed_run, "--labels", "a,b"])
    assert info.value.code == 2
    assert "--labels gives 2 labels for 1 runs" in capsys.readouterr().err


def test_a_directory_without_logs_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        milestones.main([str(tmp_path / "empty")])
    assert info.value.code == 2
    assert "cannot read" in capsys.readouterr().err
