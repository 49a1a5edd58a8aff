"""The code a run passes through: which of the repository's files a short training run
executes, their lines, and the definitions (functions, methods, classes) it enters.

    python -m bench.code_path                        # MonoBeast on CartPole, 20k steps
    python -m bench.code_path --repo ../other-checkout -- --env MinAtar/Breakout-v1

The run goes under coverage.py (pip install coverage), its actor processes and threads
included, from the repository given by --repo (default: this one), so that two checkouts
are measured the same way. A file counts when any of its lines ran; a definition counts
when any line of its body ran. Lines are split into code, docstrings and comments, and
blank lines. Measured, not asserted: the report is a markdown table on stdout.
"""

import argparse
import ast
import io
import os
import subprocess
import sys
import tempfile
import tokenize

RUN_ARGS = ("--env", "CartPole-v1", "--total_steps", "20000", "--no_progress",
            "--checkpoint_interval_s", "inf")
# The data path from the command to the loss: the entry script, the services it calls for the
# loop, and the ML files (the files that make a step, not those that log, save or evaluate).
DATA_PATH = ("monobeast.py", "beast/training.py", "beast/flags.py", "beast/learner.py",
             "beast/loss.py", "beast/policies.py", "beast/models.py", "beast/vtrace.py",
             "beast/rollout.py", "beast/vector_envs.py", "beast/envs.py",
             "beast/atari_wrappers.py")


def line_kinds(source):
    """{"code", "doc", "blank"} counts of a Python source: docstrings and comment-only lines
    are "doc"."""
    lines = source.splitlines()
    doc = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row, column = token.start
        if token.type == tokenize.COMMENT and not lines[row - 1][:column].strip():
            doc.add(row)
    blank = {i for i, line in enumerate(lines, 1) if not line.strip()}
    return dict(code=len(lines) - len(doc | blank), doc=len(doc - blank), blank=len(blank))


def definitions_entered(source, executed):
    """Qualified names of the functions and classes whose body has an executed line."""
    entered = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                body_lines = {n.lineno for stmt in child.body for n in ast.walk(stmt)
                              if hasattr(n, "lineno")}
                if isinstance(child, ast.ClassDef):
                    body_lines = {stmt.lineno for stmt in child.body
                                  if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))}
                if body_lines & executed or (isinstance(child, ast.ClassDef) and any(
                        isinstance(s, ast.FunctionDef) and s.body[0].lineno in executed
                        for s in child.body)):
                    entered.append(name)
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return entered


def measure(repo, run_args, workdir):
    """Runs monobeast from `repo` under coverage; returns {path: executed line numbers}."""
    import coverage  # only this tool needs it

    rc = os.path.join(workdir, "coveragerc")
    with open(rc, "w") as f:
        f.write(f"[run]\nconcurrency = multiprocessing,thread\nparallel = true\n"
                f"source = {repo}\ndata_file = {workdir}/.coverage\n")
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "monobeast",
               "--savedir", os.path.join(workdir, "runs"), *run_args]
    subprocess.run(command, cwd=repo, check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=repo))
    data = coverage.Coverage(config_file=rc)
    data.combine()
    measured = data.get_data()
    return {path: set(measured.lines(path) or ()) for path in measured.measured_files()}


def report(repo, executed):
    rows = []
    for path in sorted(executed):
        rel = os.path.relpath(path, repo)
        if rel.startswith(("tests", "bench", "..")) or not executed[path]:
            continue
        source = open(path).read()
        kinds = line_kinds(source)
        entered = definitions_entered(source, executed[path])
        lines = len(source.splitlines())
        rows.append((rel, lines, kinds["code"], kinds["doc"], len(entered)))
    print(f"Repository: {repo}\n")
    print("| file | lines | code | docstrings and comments | definitions entered |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| {} | {:,} | {:,} | {:,} | {} |".format(*row))
    for label, chosen in (("all", rows), ("the data path", [r for r in rows
                                                              if r[0] in DATA_PATH])):
        sums = [sum(r[i] for r in chosen) for i in range(1, 5)]
        print("| **{}: {} files** | **{:,}** | **{:,}** | **{:,}** | **{}** |".format(
            label, len(chosen), *sums))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="The checkout whose monobeast runs.")
    parser.add_argument("run_args", nargs="*", default=list(RUN_ARGS),
                        help="MonoBeast's flags for the run (after --).")
    args = parser.parse_args(argv)
    repo = os.path.abspath(args.repo)
    with tempfile.TemporaryDirectory() as workdir:
        report(repo, measure(repo, args.run_args, workdir))


if __name__ == "__main__":
    main()
