"""The README's commands, and those of the guide pages it leads to (``GUIDE``), run as written,
in order, the way a newcomer pastes them; every link of the README and of docs/ resolves.

Every ```bash and ```python block runs from a fresh directory that holds the repository's
``configs/``, with the installed ``hybridlb`` first on PATH, unless a comment right above it
says otherwise:

* ``<!-- readme-test: skip (why) -->``: not run here (it needs two machines, or it is the test
  command itself);
* ``<!-- readme-test: background -->``: a server; it runs in the background until the next
  server block or the end, and the blocks after it talk to it;
* ``<!-- readme-test: set-up; its last command runs in the background -->``: the install
  one-liner (``.ci/run`` does the install); its final command is a server, as above.

A block fails on a non-zero exit, a traceback, or an OpenAI error body in its output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# The README, then the pages a newcomer reads next, as one walk: a server one page starts
# serves the next page's requests.
GUIDE = ["README.md", "docs/coming-from-vllm.md", "docs/usage.md", "docs/deployment.md"]


@dataclass
class Block:
    line: int
    language: str
    text: str
    marker: str | None
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def guide_blocks() -> list[Block]:
    return [block for page in GUIDE for block in readme_blocks(ROOT / page)]


def readme_blocks(path: Path = ROOT / "README.md") -> list[Block]:
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    blocks, index = [], 0
    while index < len(lines):
        fence = re.fullmatch(r"```(\w+)", lines[index])
        if fence is None:
            index += 1
            continue
        end = lines.index("```", index + 1)
        marker = re.fullmatch(r"<!-- readme-test: (.*) -->", lines[index - 1]) if index else None
        blocks.append(Block(index + 1, fence.group(1), "\n".join(lines[index + 1 : end]),
                            marker.group(1) if marker else None, page))
        index = end + 1
    return blocks


def test_every_runnable_block_is_bash_or_python_and_every_marker_is_known():
    blocks = [b for b in guide_blocks() if b.language in ("bash", "python")]
    assert len(blocks) >= 8
    for block in blocks:
        assert block.marker is None or block.marker == "background" or block.marker.startswith(("skip (", "set-up;")), \
            f"{block.where}: unknown marker {block.marker!r}"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


def test_every_link_of_the_readme_and_the_docs_resolves():
    """A relative link names a file of the repository, and a #fragment a heading of that page."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_fits_on_a_screen_and_leads_to_every_guide_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in GUIDE[1:]:
        assert f"]({page})" in readme, page
