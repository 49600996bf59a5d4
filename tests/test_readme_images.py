"""Every image a README or a docs page shows is in the repository, and not git-ignored.

An ignored image stays on the machine that made it: the README shows a broken image
in every clone (``*.png`` is ignored except where .gitignore says otherwise).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _images() -> list[tuple[Path, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "plugins").glob("*/README.md"))]
    pages += [p for p in sorted((ROOT / "docs").rglob("*.md")) if "_build" not in p.parts]
    found = []
    for page in pages:
        for target in IMAGE.findall(page.read_text()):
            if "://" not in target:
                found.append((page, target))
    return found


@pytest.mark.parametrize(
    ("page", "target"),
    _images(),
    ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v,
)
def test_image_is_in_the_repository(page: Path, target: str):
    path = (page.parent / target).resolve()
    assert path.is_file(), f"{page.relative_to(ROOT)} shows {target}, which does not exist"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # an unpacked distribution: existence is all there is to check
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(path.relative_to(ROOT))], cwd=ROOT, check=False
    )
    assert ignored.returncode == 1, f"{target} is git-ignored: clones will not have it"


def test_some_image_is_checked():
    assert _images(), "no README shows an image any more: drop this test"
