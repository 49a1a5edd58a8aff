"""Throughput benchmarks of MonoBeast and PolyBeast: measurements, not tests.

    python -m bench            # the full run (about 10-12 minutes on two cores)
    python -m bench --quick    # a short version (about 4 minutes)
    python -m bench --help

Modules:
  run.py          the command line, the sections and the markdown report
  ceilings.py     environment stepping, learner step and inference alone
  endtoend.py     `python -m monobeast|polybeast` in a subprocess, SPS from logs.csv
  nullprofile.py  where the time of a null-environment step goes (in-process, py-spy)
  null_env.py     the null environment (--env bench.null_env:Null-v0), no work per step
  resize.py       python -m bench.resize: the Atari screen's resize and preprocessing

bench/README.md says what each number means.
"""
