"""No dead code in the package: ``vulture --min-confidence 80`` over ``src/gangrun`` finds
nothing. A name only a protocol uses (IPython's ``_repr_pretty_(p, cycle)``) is prefixed with
``_``. And nothing in ``src/``, ``tests/``, ``docs/`` or the README (comments, docstrings,
pages) cites a tracker's issue or item number, or a specification kept outside the
repository, instead of saying why: the reason outlives the tracker, and a reader has only the
repository."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gangrun"


def test_vulture_finds_no_dead_code():
    out = subprocess.run(
        [sys.executable, "-m", "vulture", str(SRC), "--min-confidence", "80"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# "issue 12", "issues 3", "item 7", "items 2, 4", "SPEC section 5" (the product contract is
# not in the repository); in comments also "#31" (not "#888" in code)
_CITATION = re.compile(r"\b[Ii]ssues? #?\d+|\b[Ii]tems? \d+\b|\bSPEC\b")
_HASH_NUMBER = re.compile(r"(?<![&\w])#\d+\b")


def citations(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment or string that cites an issue or item number."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            hit = _CITATION.search(tok.string) or _HASH_NUMBER.search(tok.string[1:])
        elif tok.type == tokenize.STRING:
            hit = _CITATION.search(tok.string)
        else:
            continue
        if hit:
            found.append((tok.start[0], hit.group()))
    return found


def test_no_comment_docstring_or_page_cites_an_issue_item_or_spec():
    python = [*sorted(SRC.rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    found = [
        f"{p.relative_to(ROOT)}:{line}: {text!r}"
        for p in python
        if p != Path(__file__).resolve()  # the check's own examples
        for line, text in citations(p.read_text())
    ]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found += [
        f"{p.relative_to(ROOT)}:{n}: {hit.group()!r}"
        for p in pages
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if (hit := _CITATION.search(line))
    ]
    assert not found, "say what and why, not which issue:\n" + "\n".join(found)


def test_the_citation_check_reads_comments_and_docstrings():
    source = (
        '"""Fixed for issue 12, item 3."""\n'
        'color = "#888"  # see #31\n'
        "x = 1  # the first 2 items 'shown'\n"
    )
    assert citations(source) == [(1, "issue 12"), (2, "#31")]
