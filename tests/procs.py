"""Process trees for tests that start trainers or Ray heads and must stop all of them.

torch's elastic agent and Ray start their workers in new sessions, so killing a
process group leaves them running: tests kill every descendant, read from /proc.
"""

from __future__ import annotations

import pathlib


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
