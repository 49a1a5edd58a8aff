"""The shape of the code a forker reads: short functions, one declaration per concept."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60  # code lines, the docstring not counted


def python_files():
    for pattern in ("*.py", "beast/*.py", "beast/*/*.py", "bench/*.py"):
        yield from sorted(REPO.glob(pattern))


def function_lengths(path):
    """(name, first line, code lines) of every function in the file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0]
            start = node.lineno
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                # The signature lines count, the docstring does not.
                docstring_lines = first.end_lineno - first.lineno + 1
            else:
                docstring_lines = 0
            yield node.name, start, node.end_lineno - start + 1 - docstring_lines


def test_no_function_is_longer_than_a_screen():
    long = [f"{path.relative_to(REPO)}:{line} {name} ({n} lines)"
            for path in python_files() for name, line, n in function_lengths(path)
            if n > MAX_FUNCTION_LINES]
    assert not long, "split these functions:\n" + "\n".join(long)


def calls_in(path, function):
    """The dotted names that `function` (a top-level def of the file) calls, e.g.
    "run.learner.update"."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}


def test_each_entry_script_holds_its_training_loop():
    """A forker finds the loop in the file they run: train() enters the run's services and
    its learn() takes batches, updates and records; the services never call the update."""
    for script in ("monobeast.py", "polybeast.py"):
        path = REPO / script
        assert {"training.Setup", "training.Run"} <= calls_in(path, "train"), script
        assert {"run.learner.update", "run.record"} <= calls_in(path, "learn"), script
    services = (REPO / "beast" / "training.py").read_text()
    assert "learner.update(" not in services
