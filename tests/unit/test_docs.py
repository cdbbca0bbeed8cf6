"""The repository stands alone: its documentation points only inside it.

Covers: every relative link in README.md and docs/*.md resolves to a file or
folder inside the repository; no tracked text file cites a document that
lives outside it (the team's design notes and field notes); docs/README.md
lists every page in docs/.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
OUTSIDE = re.compile(r"\.\./shared|FIELD-NOTES|DESIGN\.md")


def test_relative_links_resolve_inside_the_repository() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_no_tracked_file_cites_a_document_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    this = pathlib.Path(__file__).relative_to(ROOT).as_posix()
    citing = []
    for name in tracked:
        path = ROOT / name
        if name == this or not path.is_file() or name.startswith("devcluster/gomod/"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        citing += [f"{name}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not citing


def test_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert {p for p in pages if f"]({p})" not in index} == set()
