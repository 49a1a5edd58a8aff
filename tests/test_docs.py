"""The documents' links: every relative link resolves, and bench/results holds only what they link.

The documents are README.md, docs/*.md and bench/README.md. A report under bench/results that
one of them links counts as a document too for its own links (a report shows its figures), so
a figure is kept by the report that shows it. A link to a folder under bench/results covers
everything under it; a link to bench/results itself covers nothing.
"""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

# [text](target) and ![alt](target), with an optional "title" after the target.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def documents():
    """The documents a reader starts from."""
    docs = [REPO / "README.md", REPO / "bench" / "README.md"]
    docs += sorted((REPO / "docs").glob("*.md"))
    return [doc for doc in docs if doc.exists()]


def relative_links(doc):
    """(target path, anchor or None, the link as written) for each relative link of a
    markdown file, outside code."""
    text = INLINE_CODE.sub("", FENCE.sub("", doc.read_text(encoding="utf-8")))
    links = []
    for written in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", written, re.IGNORECASE) or written.startswith("#"):
            continue  # http(s), mailto and the like; an anchor in the same file
        path, _, anchor = written.partition("#")
        links.append(((doc.parent / path).resolve(), anchor or None, written))
    return links


def anchors(doc):
    """The anchors GitHub makes for a markdown file's headings."""
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    seen = {}
    for heading in HEADING.findall(text):
        heading = re.sub(r"`|\*\*|\*|_(?=\w)|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        yield slug if count == 0 else f"{slug}-{count}"


def reachable():
    """Every markdown file a reader can reach from the documents through bench/results, and
    the files under bench/results that a link covers."""
    to_read = list(documents())
    read, covered = set(), set()
    while to_read:
        doc = to_read.pop()
        if doc in read:
            continue
        read.add(doc)
        for target, _, _ in relative_links(doc):
            if not target.exists() or RESULTS not in target.parents:
                continue  # elsewhere, or bench/results itself, which would cover everything
            files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()]
            covered.update(files)
            to_read += [p for p in files if p.suffix == ".md"]
    return read, covered


def test_every_relative_link_resolves():
    docs, _ = reachable()
    broken = []
    for doc in sorted(docs):
        where = doc.relative_to(REPO)
        for target, anchor, written in relative_links(doc):
            if REPO not in target.parents and target != REPO:
                broken.append(f"{where}: {written} points outside the repository")
            elif not target.exists():
                broken.append(f"{where}: {written} ({target.relative_to(REPO)} does not exist)")
            elif anchor and target.suffix == ".md" and anchor not in set(anchors(target)):
                broken.append(f"{where}: {written} (no heading of "
                              f"{target.relative_to(REPO)} has the anchor #{anchor})")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_same_file_anchors_resolve():
    broken = []
    for doc in documents():
        text = INLINE_CODE.sub("", FENCE.sub("", doc.read_text(encoding="utf-8")))
        own = set(anchors(doc))
        for written in LINK.findall(text):
            if written.startswith("#") and written[1:] not in own:
                broken.append(f"{doc.relative_to(REPO)}: {written}")
    assert not broken, "anchors that no heading has:\n  " + "\n  ".join(broken)


def test_every_file_under_bench_results_is_linked():
    _, covered = reachable()
    orphans = sorted(str(p.relative_to(REPO)) for p in RESULTS.rglob("*")
                     if p.is_file() and p not in covered)
    assert not orphans, (
        "files under bench/results that no document links (link them from README.md, docs/*.md, "
        "bench/README.md or a report they link, or delete them):\n  " + "\n  ".join(orphans))


def test_link_parser_finds_what_it_should(tmp_path):
    """The checks above are only as strict as the parser: a few shapes of link it must see or
    skip, and of heading whose anchor it must make as GitHub does."""
    doc = tmp_path / "links.md"
    doc.write_text("[a](x.md) ![b](img/y.png) [c](z.md#part \"title\") [d](https://e.org/f) "
                   "[g](#top) `[h](code.md)`\n```\n[i](fenced.md)\n```\n", encoding="utf-8")
    assert [w for _, _, w in relative_links(doc)] == ["x.md", "img/y.png", "z.md#part"]
    assert relative_links(doc)[0][0] == tmp_path / "x.md"
    doc.write_text("# Pong on one GPU: +18 in 13.1 minutes\n## Reproducibility and "
                   "--deterministic\n## Other images (MinAtar)\n## Tests\n## Tests\n"
                   "```\n# not a heading\n```\n", encoding="utf-8")
    assert list(anchors(doc)) == [
        "pong-on-one-gpu-18-in-131-minutes", "reproducibility-and---deterministic",
        "other-images-minatar", "tests", "tests-1"]
