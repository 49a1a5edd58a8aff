"""Throughput benchmarks of MonoBeast and PolyBeast: measurements, not tests.

    python -m bench            # the full run (about 10-12 minutes on two cores)
    python -m bench --quick    # a short version (about 4 minutes)
    python -m bench --help

Modules:
  run.py          the command line, the sections and the markdown report
  ceilings.py     environment stepping, learner step and inference alone
  endtoend.py     `python -m monobeast|polybeast` in a subprocess, SPS from logs.csv
  nullprofile.py  where the time of a null-environment step goes (in-process, py-spy)

bench/README.md says what each number means.
"""
