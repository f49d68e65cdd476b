"""The README stays short and its links resolve; every tool in tools/ is named in the docs."""

from __future__ import annotations

import re

from tests.conftest import REPO


def test_readme_is_short_and_every_link_resolves():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_every_tool_is_documented():
    layout = (REPO / "docs/layout.md").read_text()
    missing = [p.name for p in sorted((REPO / "tools").glob("*.py")) if p.name not in layout]
    assert not missing, f"docs/layout.md does not name {missing}"
