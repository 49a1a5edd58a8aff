"""bench.read_figure against a figure drawn here, whose curves are known: the grid lines it
finds are where matplotlib put the ticks, and the values it reads are the curve's, not those of
the pale seed curves or of another run's colour beside it."""

import math

import matplotlib
import numpy as np
import pytest

from bench import read_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GREEN, BLUE = (85, 168, 104), (76, 114, 176)
X_TICKS = [0, 2e6, 4e6, 6e6, 8e6, 10e6]
Y_TICKS = [0, 100, 200, 300]


def mean_curve(x):
    return 300 * (1 - math.exp(-x / 4e6))


@pytest.fixture(scope="module")
def figure(tmp_path_factory):
    """A panel as peers draw them: a dark mean curve (green) that stops at 8M steps, a pale
    seed curve of the same hue above it, another run's curve (blue) crossing it, grey grid
    lines. Returns (path, box, tick columns, tick rows) in the PNG's pixels."""
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    x = np.linspace(0, 8e6, 400)
    mean = np.array([mean_curve(v) for v in x])
    pale = tuple(c / 255 * 0.3 + 0.7 for c in GREEN)  # the colour blended 70% with white
    ax.plot(x, mean + 40, color=pale, linewidth=1.5)
    ax.plot(x, mean, color=[c / 255 for c in GREEN], linewidth=1.5)
    ax.plot(np.linspace(0, 10e6, 400), np.linspace(50, 250, 400),
            color=[c / 255 for c in BLUE], linewidth=1.5)
    ax.set_xlim(-0.3e6, 10.3e6)
    ax.set_ylim(-20, 330)
    ax.set_xticks(X_TICKS)
    ax.set_yticks(Y_TICKS)
    ax.grid(color=[c / 255 for c in read_figure.GRID_COLOUR], linewidth=0.8)
    path = tmp_path_factory.mktemp("figure") / "panel.png"
    fig.canvas.draw()
    height = fig.canvas.get_width_height()[1]
    to_pixels = ax.transData.transform
    # Display coordinates run from pixel edges, bottom up; pixel indices name their centres.
    columns = [to_pixels((v, 0))[0] - 0.5 for v in X_TICKS]
    rows = [height - to_pixels((0, v))[1] - 0.5 for v in Y_TICKS]
    (left, bottom), (right, top) = ax.transAxes.transform([(0, 0), (1, 1)])
    box = (math.ceil(left) + 2, math.ceil(height - top) + 2,
           math.floor(right) - 2, math.floor(height - bottom) - 2)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, box, columns, rows


def axes(columns, rows):
    """The axes calibrated from the first and last grid line of each (as a user does)."""
    x_axis = read_figure.Axis(f"{columns[0]}={X_TICKS[0]},{columns[-1]}={X_TICKS[-1]}")
    y_axis = read_figure.Axis(f"{rows[0]}={Y_TICKS[0]},{rows[-1]}={Y_TICKS[-1]}")
    return x_axis, y_axis


def test_the_grid_lines_found_are_the_ticks(figure):
    path, box, tick_columns, tick_rows = figure
    columns, rows = read_figure.grid_lines(read_figure.load_rgb(path), box)
    assert len(columns) == len(X_TICKS)
    assert all(abs(c - t) <= 1 for c, t in zip(columns, tick_columns)), (columns, tick_columns)
    # Horizontal lines from the bottom up; the curves may hide one, never add one.
    assert set(round(r) for r in rows) <= {round(t) + d for t in tick_rows for d in (-1, 0, 1)}
    assert len(rows) >= len(Y_TICKS) - 1


def test_the_curve_is_read_within_two_pixel_rows_of_its_values(figure):
    path, box, tick_columns, tick_rows = figure
    image = read_figure.load_rgb(path)
    columns, _ = read_figure.grid_lines(image, box)
    x_axis, y_axis = axes(columns, tick_rows)
    at = [0.5e6, 1e6, 2e6, 3.3e6, 5e6, 7.5e6]
    readings = read_figure.read_curve(image, box, GREEN, x_axis, y_axis, at)
    one_row = abs(y_axis.per_pixel)
    for x, value, found in readings:
        # Matplotlib snaps grid lines to whole pixels, so the calibration is good to about a
        # pixel, and on the curve's steepest stretch one pixel column moves it 1.5 rows.
        assert found > 0 and abs(value - mean_curve(x)) <= 2 * one_row, (x, value, found)
    blue = read_figure.read_curve(image, box, BLUE, x_axis, y_axis, [1e6, 9e6])
    assert [round(v) for _, v, _ in blue] == pytest.approx([70, 230], abs=2 * one_row)


def test_where_the_curve_has_ended_there_is_no_value(figure):
    path, box, tick_columns, tick_rows = figure
    image = read_figure.load_rgb(path)
    x_axis, y_axis = axes(tick_columns, tick_rows)
    [(_, value, found)] = read_figure.read_curve(image, box, GREEN, x_axis, y_axis, [9.5e6])
    assert value is None and found == 0
    with pytest.raises(ValueError, match="outside the box's columns"):
        read_figure.read_curve(image, box, GREEN, x_axis, y_axis, [20e6])


def test_the_command_reads_the_curve_and_refuses_bad_input(figure, capsys):
    path, box, tick_columns, tick_rows = figure
    box_flag = ",".join(map(str, box))
    assert read_figure.main([str(path), "--box", box_flag, "--grid"]) == 0
    assert "vertical grid lines (pixel columns):" in capsys.readouterr().out
    x = f"{tick_columns[0]:.1f}=0,{tick_columns[-1]:.1f}=10e6"
    y = f"{tick_rows[0]:.1f}=0,{tick_rows[-1]:.1f}=300"
    assert read_figure.main([str(path), "--box", box_flag, "--x", x, "--y", y,
                             "--colour", "85,168,104", "--at", "4e6"]) == 0
    value = float(capsys.readouterr().out.splitlines()[-1].split("|")[1])
    assert value == pytest.approx(mean_curve(4e6), abs=3)
    assert read_figure.main([str(path), "--box", box_flag, "--x", x, "--y", y, "--colour",
                             "85,168,104", "--at", "4e6", "--tolerance", "-1"]) == 2
    assert "--tolerance -1: give 0-255" in capsys.readouterr().err
    for flag, value, words in [("--colour", "green", "give R,G,B"),
                               ("--x", "1=0", "give two grid lines"),
                               ("--box", "a,b,c,d", "four whole pixel numbers")]:
        args = {"--box": box_flag, "--x": x, "--y": y, "--colour": "85,168,104", "--at": "4e6",
                flag: value}
        assert read_figure.main([str(path), *[v for kv in args.items() for v in kv]]) == 2
        assert words in capsys.readouterr().err
    assert read_figure.main([str(path), "--box", box_flag, "--x", x]) == 2
    assert "give --y, --colour, --at" in capsys.readouterr().err
    assert read_figure.main([str(path), "--box", "10,10,5,5", "--grid"]) == 2
    assert "top-left corner first" in capsys.readouterr().err
    assert read_figure.main([str(path), "--box", "0,0,5000,10", "--grid"]) == 2
    assert "reaches outside the" in capsys.readouterr().err
