"""Plots the mean episode return of one or more runs into a PNG.

    python -m beast.plot ~/logs/beast/run1 ~/logs/beast/run2 -o returns.png
    python -m beast.plot ~/logs/beast            # every run under a savedir
"""

import argparse
import math
import os

from beast.runlog import read_logs


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


def plot_runs(runs, output, x="step", y="mean_episode_return", smoothing=1):
    """Draws y against x, one line per run (labelled by xpid), and saves output."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, e.g. over ssh
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        rows = read_logs(os.path.join(run, "logs.csv"))
        missing = [c for c in (x, y) if rows and c not in rows[0]]
        if missing:
            raise ValueError(
                f"{run}/logs.csv has no column {missing[0]!r} (it has: {', '.join(rows[0])})"
            )
        start = rows[0][x] if rows and x == "_time" else 0.0
        # nan: no episode had finished yet at that logging point.
        points = [(r[x] - start, r[y]) for r in rows if not math.isnan(r[y])]
        xs = [p[0] for p in points]
        ys = smooth([p[1] for p in points], max(1, smoothing))
        ax.plot(xs, ys, label=os.path.basename(os.path.normpath(run)))
    ax.set_xlabel("seconds since start" if x == "_time" else "environment steps")
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
                        help="Horizontal axis: environment steps or wall-clock seconds.")
    parser.add_argument("--y", default="mean_episode_return", help="logs.csv column to plot.")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="Average each point with the N-1 before it (1: no smoothing).")
    flags = parser.parse_args(argv)
    try:
        runs = find_runs(flags.runs)
        plot_runs(runs, flags.output, x=flags.x, y=flags.y, smoothing=flags.smooth)
    except (ValueError, OSError) as e:
        parser.error(str(e))  # one clear message and exit status 2, no traceback
    print(f"wrote {flags.output} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    return flags.output


if __name__ == "__main__":
    main()
