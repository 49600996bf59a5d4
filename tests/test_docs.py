"""The documentation site's includes: every README marker a page names exists, in order.

The site itself is built in CI (scripts/test.sh, Sphinx with warnings as errors);
this checks, without Sphinx, what an edit of a README most easily breaks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
INCLUDE = re.compile(r"```\{(?:include|literalinclude)\} (\S+)\n((?::[\w-]+:.*\n)*)```")


def _includes() -> list[tuple[Path, Path, dict[str, str]]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" in page.parts:
            continue
        for m in INCLUDE.finditer(page.read_text()):
            options = dict(re.findall(r":([\w-]+):\s*(.*)", m.group(2)))
            found.append((page, (page.parent / m.group(1)).resolve(), options))
    return found


def test_pages_include_something():
    assert len(_includes()) > 20


@pytest.mark.parametrize(
    ("page", "target", "options"),
    _includes(),
    ids=lambda v: str(v.relative_to(DOCS.parent)) if isinstance(v, Path) else "",
)
def test_included_file_and_markers_exist(page, target, options):
    assert target.is_file(), f"{page.name} includes {target}, which does not exist"
    text = target.read_text()
    start, end = options.get("start-after"), options.get("end-before")
    if start is not None:
        assert text.count(start) == 1, f"{target.name}: marker {start!r} must appear once"
    if end is not None:
        assert text.count(end) == 1, f"{target.name}: marker {end!r} must appear once"
    if start is not None and end is not None:
        assert text.index(start) < text.index(end), f"{target.name}: {start!r} after {end!r}"


def test_every_readme_marker_pair_is_whole():
    """A start marker has its end, so that an include never runs to the end of a README."""
    for readme in [
        DOCS.parent / "README.md",
        *sorted((DOCS.parent / "plugins").glob("*/README.md")),
    ]:
        text = readme.read_text()
        starts = re.findall(r"<!-- docs:([\w-]+):start -->", text)
        ends = re.findall(r"<!-- docs:([\w-]+):end -->", text)
        assert sorted(starts) == sorted(ends), readme
        assert len(set(starts)) == len(starts), f"{readme}: a marker name used twice"
