"""Plots the mean episode return of one or more runs into a PNG.

    python -m beast.plot ~/logs/beast/run1 ~/logs/beast/run2 -o returns.png
    python -m beast.plot ~/logs/beast            # every run under a savedir
    python -m beast.plot runs --x _time --target 18 --reference "a peer@1800=18"
"""

import argparse
import math
import os
import re

from beast.runlog import read_logs, start_times, training_seconds


def find_runs(paths):
    """Run directories (those holding logs.csv) for each path given.

    A path is either a run directory or a parent whose subdirectories are runs.
    Raises ValueError naming a path under which no logs.csv was found.
    """
    runs = []
    for path in paths:
        path = os.path.expanduser(path)
        if os.path.isfile(os.path.join(path, "logs.csv")):
            runs.append(path)
            continue
        children = []
        if os.path.isdir(path):
            children = [
                os.path.join(path, name)
                for name in sorted(os.listdir(path))
                if os.path.isfile(os.path.join(path, name, "logs.csv"))
            ]
        if not children:
            raise ValueError(
                f"no logs.csv in {path} or its subdirectories: give a run directory "
                "(savedir/xpid) or a savedir that holds runs"
            )
        runs.extend(children)
    return runs


def smooth(values, window):
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def parse_reference(text):
    """'LABEL@X=Y' (a published point: X in the plot's units, with k or M for thousands or
    millions) -> (label, x, y). Raises ValueError saying what to write."""
    match = re.fullmatch(r"(.*\S)\s*@\s*([-+0-9.eE]+)([kM]?)\s*=\s*([-+0-9.eE]+)", text.strip())
    try:
        label, x, unit, y = match.groups()
        return label.strip(), float(x) * {"": 1, "k": 1e3, "M": 1e6}[unit], float(y)
    except (AttributeError, ValueError):
        raise ValueError(f"--reference {text!r}: write LABEL@X=Y, e.g. "
                         "'CleanRL PPO@2.5M=18' (X in the plot's units)") from None


def curve(run, x, y, smoothing):
    """(xs, ys) of one run: y against steps or, for x "_time", against its seconds of
    training (a resume's pause left out, runlog.training_seconds)."""
    rows = read_logs(os.path.join(run, "logs.csv"))
    missing = [c for c in (x, y) if rows and c not in rows[0]]
    if missing:
        raise ValueError(
            f"{run}/logs.csv has no column {missing[0]!r} (it has: {', '.join(rows[0])})"
        )
    xs = [r[x] for r in rows]
    if x == "_time":
        xs = training_seconds(xs, start_times(run))
    # nan: no episode had finished yet at that logging point.
    points = [(at, r[y]) for at, r in zip(xs, rows) if not math.isnan(r[y])]
    return [p[0] for p in points], smooth([p[1] for p in points], max(1, smoothing))


def plot_runs(runs, output, x="step", y="mean_episode_return", smoothing=1, target=None,
              references=()):
    """Draws y against x, one line per run (labelled by xpid), a dotted line at `target`
    and a marker per (label, x, y) of `references`, and saves output."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, e.g. over ssh
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        ax.plot(*curve(run, x, y, smoothing), label=os.path.basename(os.path.normpath(run)))
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", label=f"target {target:g}")
    for marker, (label, at, value) in zip("*DPXv^<>", references):
        ax.plot([at], [value], marker=marker, markersize=11, color="black", linestyle="",
                label=label)
    ax.set_xlabel("seconds of training" if x == "_time" else "environment steps")
    ax.set_ylabel(y.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m beast.plot",
        description="Plot mean episode return of beast runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="Run directories (savedir/xpid), or savedirs holding several runs.")
    parser.add_argument("-o", "--output", default="returns.png", help="PNG file to write.")
    parser.add_argument("--x", default="step", choices=["step", "_time"],
                        help="Horizontal axis: environment steps, or seconds of training "
                             "(wall-clock, the pauses between a stop and its resume left out).")
    parser.add_argument("--y", default="mean_episode_return", help="logs.csv column to plot.")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="Average each point with the N-1 before it (1: no smoothing).")
    parser.add_argument("--target", type=float, default=None,
                        help="Draw a dotted horizontal line at this value, e.g. a return "
                             "that counts as solved.")
    parser.add_argument("--reference", action="append", default=[], metavar="LABEL@X=Y",
                        help="Mark a published point, e.g. 'CleanRL PPO@2.5M=18': X in the "
                             "axis's units (steps, or seconds with --x _time), k and M for "
                             "thousands and millions. Repeatable (up to 8).")
    flags = parser.parse_args(argv)
    try:
        references = [parse_reference(text) for text in flags.reference]
        if len(references) > 8:
            raise ValueError(f"{len(references)} --reference points: give at most 8")
        runs = find_runs(flags.runs)
        plot_runs(runs, flags.output, x=flags.x, y=flags.y, smoothing=flags.smooth,
                  target=flags.target, references=references)
    except (ValueError, OSError) as e:
        parser.error(str(e))  # one clear message and exit status 2, no traceback
    print(f"wrote {flags.output} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    return flags.output


if __name__ == "__main__":
    main()
