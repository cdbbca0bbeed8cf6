"""Pure decisions of a restore: what one rank found about a copy, and what all agree.

A restore tries *copies* of steps (`Copy`: the local folder, the S3 prefix,
a foreign DCP folder). Every rank checks its share of a copy and reports one
`Report`; `judge` folds all ranks' reports into the verdict every rank acts
on. The statuses, from the strongest:

    transport   S3 kept failing transiently after bounded retries: the
                restore FAILS (raises TransportError); never a fallback
    refused     S3 refused a request (access denied...): the restore fails
    corrupt     bytes present but their size/CRC32C differ from the manifest:
                proven; a copy of this job is quarantined (moved aside)
    unreadable  cannot be read (EACCES, newer manifest format, invalid
                manifest, unsafe path) or refused as not plain data (DCP
                metadata or bytes entries: `cairn.checkpoint.vet`): kept,
                never deleted; next copy
    incomplete  a listed file or object is absent: kept; next copy
    foreign     not this job's own: another job's step, or a manifest that
                does not authenticate with the job's key (issue 19); kept,
                only an explicit import (resume.uri) may load it
    ok          verified: load it

No I/O here; `cairn.checkpoint.restore` does the fetching and acting.
"""

from __future__ import annotations

import dataclasses
import typing

from cairn.checkpoint import errors, layout

Status = typing.Literal[
    "ok", "foreign", "incomplete", "unreadable", "corrupt", "refused", "transport"
]
STRENGTH: tuple[Status, ...] = (
    "ok",
    "foreign",
    "incomplete",
    "unreadable",
    "corrupt",
    "refused",
    "transport",
)
Source = typing.Literal["memory", "local", "s3"]
"""`memory`: every rank's own memory copy, else its peer's replica (`memrestore`)."""
Action = typing.Literal["load", "quarantine", "skip", "fail"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Copy:
    """One place a step can be loaded from."""

    step: int
    source: Source
    own: bool = True
    """A step of this job: a proven-corrupt copy is quarantined. False for
    foreign steps and imports, which are never touched."""
    plain_dcp: bool = False
    """No Cairn manifest: verified and loaded by `cairn.checkpoint.foreign`."""
    bucket: str | None = None
    """S3 copies outside the job's own prefix (`resume.uri`): the bucket..."""
    folder_prefix: str | None = None
    """...and the key prefix of the step folder. None: the job's own prefix."""

    def to_json(self) -> dict[str, typing.Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: typing.Mapping[str, typing.Any]) -> Copy:
        return cls(**doc)

    @property
    def label(self) -> str:
        if self.folder_prefix is not None:
            where = f"s3://{self.bucket}/{self.folder_prefix}"
            return where if self.plain_dcp else f"step {self.step} ({where})"
        return f"step {self.step} ({self.source})"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    """What one rank found about one copy."""

    status: Status
    detail: str = ""
    rank: int = 0

    def to_json(self) -> dict[str, typing.Any]:
        return {"status": self.status, "detail": self.detail, "rank": self.rank}

    @classmethod
    def from_json(cls, doc: typing.Mapping[str, typing.Any]) -> Report:
        return cls(status=doc["status"], detail=doc.get("detail", ""), rank=doc.get("rank", 0))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    status: Status
    reason: str
    """Every rank's non-ok finding, `rank r: detail; ...` ('' when ok)."""


def judge(reports: typing.Sequence[Report]) -> Verdict:
    """The strongest status of all ranks' reports and their reasons. Pure."""
    if not reports:
        return Verdict(status="incomplete", reason="no rank reported")
    status = max((r.status for r in reports), key=STRENGTH.index)
    reason = "; ".join(f"rank {r.rank}: {r.detail}" for r in reports if r.status != "ok")
    return Verdict(status=status, reason=reason)


def status_of_problems(problems: typing.Sequence[layout.Problem]) -> Status:
    """Classify `layout.verify_files` findings. Pure.

    Only a size or CRC32C mismatch of a file that is there proves corruption;
    a missing file is an incomplete copy, an unsafe path an unreadable one.
    """
    if not problems:
        return "ok"
    reasons = [p.reason for p in problems]
    if any(r.startswith(("size ", "crc32c ")) for r in reasons):
        return "corrupt"
    if all(r == "missing" for r in reasons):
        return "incomplete"
    return "unreadable"


def describe(problems: typing.Sequence[layout.Problem], *, limit: int = 5) -> str:
    """A short human line for a list of problems. Pure."""
    shown = "; ".join(f"{p.path}: {p.reason}" for p in problems[:limit])
    more = len(problems) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


def action(status: Status, *, ours: bool) -> Action:
    """What every rank does with a copy after the verdict. Pure.

    load        verified
    fail        S3 kept failing or refused: the restore fails (never a
                fallback because of the network)
    quarantine  proven corrupt, and a step of this job: moved aside
    skip        anything else (unreadable, incomplete, foreign, or another
                job's corrupt copy): kept where it is, next copy
    """
    if status == "ok":
        return "load"
    if status in ("transport", "refused"):
        return "fail"
    if status == "corrupt" and ours:
        return "quarantine"
    return "skip"


def give_up(
    skipped: typing.Sequence[tuple[int, str]], *, explicit: bool, target: str | int | None
) -> errors.CheckpointError | None:
    """The outcome when no copy loaded: the error to raise, or None (fresh start). Pure.

    An explicit target (resume.step / resume.uri) that cannot be loaded is a
    configuration error; committed steps that all failed are a checkpoint
    error, never a silent fresh start; nothing at all is a fresh start.
    """
    if explicit:
        name = target if isinstance(target, str) else f"step {target}"
        return errors.ConfigurationError(
            f"resume target {name} cannot be loaded: " + "; ".join(r for _, r in skipped)
        )
    if skipped:
        return errors.CheckpointError(
            "no committed checkpoint step verified: "
            + "; ".join(f"step {s}: {r}" for s, r in skipped)
        )
    return None
