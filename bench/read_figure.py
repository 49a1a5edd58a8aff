"""python -m bench.read_figure: a curve's values read off a published figure, by its colour.

Peers often publish a learning curve as a picture and their numbers only at the end of
training; comparing per step needs the curve's value at the steps our runs reach. This reads
it from the pixels: the axes are calibrated by two grid lines per axis (their pixel positions,
and the values their tick labels give), and the curve's value at a step is the middle of the
pixels of its colour in that pixel column.

First the box of one panel's axes (pixel coordinates, from any image viewer) and its grid
lines; then the curve at the steps wanted:

  python -m bench.read_figure FIG.png --box 88,115,392,350 --grid
  python -m bench.read_figure FIG.png --box 88,115,392,350 --x 102=0,378=50e6 \\
      --y 344=0,143=8000 --colour 85,168,104 --at 1e6,2e6,5e6,10e6

A reading is as good as the figure's resolution: one pixel column spans (x range / plot
width) steps, one pixel row (y range / plot height) of return; the table says both.
"""

import argparse
import sys

import numpy as np
from PIL import Image

# Matplotlib's default grid lines, and seaborn's on a white background, are light grey.
GRID_COLOUR = (215, 215, 215)
# A pixel whose every channel is within this of a colour has that colour: wide enough for the
# anti-aliased edge of a line's core, narrow enough to leave the paler seed curves and the
# grid out.
TOLERANCE = 30
# A row or column of the box is a grid line when at least this share of its pixels has the
# grid's colour: the curves cross it, the legend may cover part of it.
GRID_SHARE = 0.5


def load_rgb(path):
    """The image at path as a uint8 array [height, width, 3] (transparency dropped)."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def parse_box(text):
    """'x0,y0,x1,y1' (pixels, corners included) -> (x0, y0, x1, y1) with x0 < x1, y0 < y1."""
    try:
        x0, y0, x1, y1 = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--box {text}: give four whole pixel numbers, X0,Y0,X1,Y1") from None
    if x0 >= x1 or y0 >= y1:
        raise ValueError(f"--box {text}: give the top-left corner first, then the bottom-right")
    return x0, y0, x1, y1


def parse_colour(text):
    try:
        rgb = tuple(int(v) for v in text.split(","))
    except ValueError:
        rgb = ()
    if len(rgb) != 3 or not all(0 <= v <= 255 for v in rgb):
        raise ValueError(f"--colour {text}: give R,G,B, each 0-255")
    return rgb


class Axis:
    """A linear map between pixel positions and values, from two (pixel, value) pairs."""

    def __init__(self, text):
        """text: 'PX=VALUE,PX=VALUE', e.g. '102=0,378=50e6'."""
        try:
            pairs = [tuple(float(v) for v in pair.split("=")) for pair in text.split(",")]
        except ValueError:
            pairs = []
        if (len(pairs) != 2 or any(len(pair) != 2 for pair in pairs)
                or pairs[0][0] == pairs[1][0] or pairs[0][1] == pairs[1][1]):
            raise ValueError(f"{text!r}: give two grid lines as PX=VALUE,PX=VALUE, at different "
                             "pixels and values")
        (self.p0, self.v0), (p1, v1) = pairs
        self.per_pixel = (v1 - self.v0) / (p1 - self.p0)

    def value(self, pixel):
        return self.v0 + (pixel - self.p0) * self.per_pixel

    def pixel(self, value):
        return self.p0 + (value - self.v0) / self.per_pixel


def matches(pixels, colour, tolerance=TOLERANCE):
    """A boolean mask of the pixels ([..., 3]) within tolerance of colour in every channel."""
    difference = np.abs(pixels.astype(np.int16) - np.asarray(colour, np.int16))
    return (difference <= tolerance).all(axis=-1)


def grid_lines(image, box, colour=GRID_COLOUR, tolerance=8, share=GRID_SHARE):
    """(columns, rows): the pixel positions of the vertical and horizontal grid lines inside
    box, each the middle of a run of adjacent lines of the grid's colour."""
    x0, y0, x1, y1 = box
    mask = matches(image[y0:y1 + 1, x0:x1 + 1], colour, tolerance)
    columns = _runs(np.flatnonzero(mask.mean(axis=0) >= share) + x0)
    rows = _runs(np.flatnonzero(mask.mean(axis=1) >= share) + y0)
    return columns, rows


def _runs(indices):
    """The middle of each run of consecutive integers, as floats."""
    runs, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            runs.append((start + index) / 2)
            start = None
    return runs


def read_curve(image, box, colour, x_axis, y_axis, at, tolerance=TOLERANCE, half_width=1):
    """The curve's value at each x in `at`: [(x, value or None, pixels found)]. The value is
    the middle (median) row of the colour's pixels in the columns within half_width of x's
    column, inside box; None where the colour is not there (the curve ends before x)."""
    x0, y0, x1, y1 = box
    readings = []
    for x in at:
        column = int(round(x_axis.pixel(x)))
        if not x0 <= column <= x1:
            raise ValueError(f"x = {x:g} is at pixel column {column}, outside the box's "
                             f"columns {x0}-{x1}: check --x and --box")
        left, right = max(x0, column - half_width), min(x1, column + half_width)
        rows, _ = np.nonzero(matches(image[y0:y1 + 1, left:right + 1], colour, tolerance))
        value = y_axis.value(float(np.median(rows)) + y0) if len(rows) else None
        readings.append((x, value, len(rows)))
    return readings


def make_parser():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("figure", help="The figure, a PNG (or any image Pillow reads).")
    parser.add_argument("--box", required=True,
                        help="X0,Y0,X1,Y1: the panel's axes in pixels, top-left then "
                             "bottom-right; only pixels inside it are read.")
    parser.add_argument("--grid", action="store_true",
                        help="List the grid lines' pixel positions inside --box, to calibrate "
                             "--x and --y with, and stop.")
    parser.add_argument("--grid_colour", default=",".join(map(str, GRID_COLOUR)),
                        help="R,G,B of the grid lines.")
    parser.add_argument("--x", help="Two vertical grid lines as PX=VALUE,PX=VALUE (pixel "
                                    "column = the step its tick label gives).")
    parser.add_argument("--y", help="Two horizontal grid lines as PY=VALUE,PY=VALUE.")
    parser.add_argument("--colour", help="R,G,B of the curve to read (its dark line, not the "
                                         "pale band around it).")
    parser.add_argument("--tolerance", type=int, default=TOLERANCE,
                        help="Largest difference per channel from --colour that still counts.")
    parser.add_argument("--at", help="The x values to read the curve at, comma-separated.")
    return parser


def main(argv=None):
    parser = make_parser()
    flags = parser.parse_args(argv)
    try:
        image = load_rgb(flags.figure)
        box = parse_box(flags.box)
        height, width = image.shape[:2]
        if box[2] >= width or box[3] >= height:
            raise ValueError(f"--box {flags.box} reaches outside the {width}x{height} image")
        if flags.grid:
            columns, rows = grid_lines(image, box, parse_colour(flags.grid_colour))
            print("vertical grid lines (pixel columns):", " ".join(f"{c:g}" for c in columns))
            print("horizontal grid lines (pixel rows):", " ".join(f"{r:g}" for r in rows))
            return 0
        missing = [f"--{name}" for name in ("x", "y", "colour", "at")
                   if getattr(flags, name) is None]
        if missing:
            raise ValueError(f"give {', '.join(missing)} (or --grid to find the grid lines)")
        if not 0 <= flags.tolerance <= 255:
            raise ValueError(f"--tolerance {flags.tolerance}: give 0-255 (a channel's range)")
        x_axis, y_axis = Axis(flags.x), Axis(flags.y)
        at = [float(v) for v in flags.at.split(",")]
        readings = read_curve(image, box, parse_colour(flags.colour), x_axis, y_axis, at,
                              flags.tolerance)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"one pixel: {abs(x_axis.per_pixel):.4g} in x, {abs(y_axis.per_pixel):.4g} in y")
    print("x | value | pixels of the colour")
    for x, value, found in readings:
        print(f"{x:g} | {'not found' if value is None else f'{value:.4g}'} | {found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
