"""No measured figure or date in the product code's comments, docstrings and help strings.

A figure measured on one machine on one day goes stale as the code and the machines change,
and a comment cannot say when it stopped being true. Comments say why, in the present tense;
measurements live in docs/ and bench/results with the command and the machine that made them
(git keeps their history). Constants and thresholds are fine: they are what the code does.

Python files are read with the tokenize module (comments and every string literal, so
docstrings and argparse help strings included); C++ and .proto files by their // and /* */
comments; shell scripts by their # comments.
"""

import glob
import io
import os
import re
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRODUCT_FILES = (["monobeast.py", "polybeast.py", "polybeast_env.py", "setup.py",
                  "beast/*.py", "csrc/*.h", "csrc/*.cc", "csrc/*.proto", "scripts/*"])

_COMPARED = r"(faster|slower|more|fewer|less|higher|lower|SPS|speed|throughput)"
# (what it is, the pattern); each matches within one line of a comment or string.
STALE = [
    ("a date", re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")),
    ("a throughput", re.compile(r"\d[\d,.]*\s*k?\s*(SPS|steps/s)\b")),
    ("a speed ratio", re.compile(
        r"\b\d+(\.\d+)?\s?x\s+(faster|slower|as fast|as slow|the speed|more|fewer|less)\b"
        r"|\b\d+\.\d+x\b", re.I)),
    ("a measured percentage", re.compile(
        rf"\d+(\.\d+)?\s?%[^.;:]{{0,40}}\b{_COMPARED}\b"
        rf"|\b{_COMPARED}\b[^.;:]{{0,40}}\d+(\.\d+)?\s?%", re.I)),
    ("a mean and spread", re.compile(r"\d\s*(\+-|\+/-|±)\s*\d")),
    ("a measurement", re.compile(r"\bmeasured\b.*\d|\d.*\bmeasured\b", re.I)),
    ("a tally of seeds or runs", re.compile(
        r"\b\d+ (of \d+ )?seeds\b|\b\d+ of \d+ (runs|seeds|tuning runs)\b")),
    ("a median", re.compile(r"\bmedian\b.*\d|\d.*\bmedian\b", re.I)),
]


def product_files():
    paths = []
    for pattern in PRODUCT_FILES:
        paths += sorted(glob.glob(os.path.join(REPO, pattern)))
    return [p for p in paths if os.path.isfile(p)]


def python_texts(source):
    """(line number, text) of every line of every comment and string literal."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def cpp_texts(source):
    """(line number, text) of every // comment and every line of a /* */ comment."""
    in_block = False
    for number, line in enumerate(source.splitlines(), 1):
        if in_block:
            end = line.find("*/")
            yield number, line if end < 0 else line[:end]
            in_block = end < 0
            continue
        comment = re.search(r"//.*|/\*.*", line)
        if comment:
            text = comment.group()
            yield number, text
            in_block = text.startswith("/*") and "*/" not in text


def shell_texts(source):
    for number, line in enumerate(source.splitlines(), 1):
        comment = re.search(r"(^|\s)#.*", line)
        if comment:
            yield number, comment.group()


def texts(path, source):
    if path.endswith(".py"):
        return python_texts(source)
    if path.endswith((".h", ".cc", ".proto")):
        return cpp_texts(source)
    return shell_texts(source)


def stale_lines(path, source):
    """["file:line: what (the text)"] for every line of `source` that holds a stale figure."""
    found = []
    name = os.path.relpath(path, REPO)
    for number, text in texts(path, source):
        for what, pattern in STALE:
            if pattern.search(text):
                found.append(f"{name}:{number}: {what}: {text.strip()}")
                break
    return found


def test_no_measured_figure_or_date_in_comments_docstrings_or_help():
    found = []
    for path in product_files():
        with open(path, encoding="utf-8") as f:
            found += stale_lines(path, f.read())
    assert not found, ("measured figures or dates in comments, docstrings or help strings; "
                       "say why in the present tense and keep the figures in docs/:\n  "
                       + "\n  ".join(found))


def test_the_scan_finds_what_it_looks_for():
    python = '''
# ran at 1,023-1,071 SPS on 2 cores
def f():
    """Twice as fast as before 2026-11-26 (README)."""
    parser.add_argument("--x", help="1.12x, one run each")
    return "a" + "b"  # 8-13% more SPS
X = 1  # 186.7 +- 17.5 over 3 seeds
Y = 2  # reached 475 at 0.26M steps in the median
Z = 3  # a constant: 100 ms doubling up to 2 s, the 10x of RMSprop's first steps
'''
    found = stale_lines(os.path.join(REPO, "example.py"), python)
    assert [line.split(":")[1] for line in found] == ["2", "4", "5", "6", "7", "8"], found
    cpp = "int x;  // measured: 4 us a call\n/* dated\n   2025-01-02 */\nint y;  // 2 s\n"
    found = stale_lines(os.path.join(REPO, "x.h"), cpp)
    assert [line.split(":")[1] for line in found] == ["1", "3"], found
    shell = "echo 50%  # on 2 cores, 20% faster\nrun --steps 5000\n"
    assert len(stale_lines(os.path.join(REPO, "scripts/x.sh"), shell)) == 1
