"""The in-memory tier's pure parts and its folder handling (real temp dirs).

Covers: which files a rank keeps (`share_entries`); `keep_own` copies them
atomically with an index from the manifest's CRC32C and drops the older
step only after the new one is complete, and replaces a re-committed step;
`memory_step` (the newest step every rank can get from its own memory or
its successor's replica; malformed reports count as nothing held); the
options and the pod env (`CAIRN_MEMORY_DIR`, `CAIRN_MEMORY_REPLICAS`); with
the tier off (the default) nothing starts; a started tier (one rank, its
replica server up) keeps a committed step off the caller's thread and
closes with and without the close barrier; a fetched replica is checked
against the manifest by the size and CRC32C counted on arrival
(`memrestore.received_problems`: a changed CRC32C or size, a missing file).
"""

from __future__ import annotations

import json
import pathlib
import typing

import pytest
from awscrt import checksums

from cairn.api import manifest as manifest_mod
from cairn.api import podenv
from cairn.checkpoint import coordinator, events, memrestore, memtier, options, runtime_config

RING = manifest_mod.Keyring(current="k1", keys={"k1": bytes(range(32))})


def _committed(
    folder: pathlib.Path, step: int, files: dict[str, tuple[int, bytes]]
) -> manifest_mod.Manifest:
    """A committed step folder: `files` name -> (writer rank, bytes), and its manifest."""
    folder.mkdir(parents=True)
    entries = []
    for name, (rank, data) in files.items():
        (folder / name).write_bytes(data)
        crc = f"{checksums.crc32c(data):08x}"
        entries.append(manifest_mod.FileEntry(path=name, size=len(data), crc32c=crc, rank=rank))
    manifest = manifest_mod.Manifest(
        step=step, world_size=2, attempt=1, created_at=1.0, files=tuple(entries), job_uid="u"
    )
    (folder / manifest_mod.MANIFEST_NAME).write_bytes(manifest_mod.dump_manifest(manifest))
    return manifest


FILES = {".metadata": (0, b"meta"), "__0_0.distcp": (0, b"zero" * 10), "__1_0.distcp": (1, b"one")}


@pytest.mark.parametrize(
    ("rank", "names"),
    [(0, [".metadata", "__0_0.distcp"]), (1, [".metadata", "__1_0.distcp"])],
)
def test_share_entries_are_own_files_and_metadata(
    tmp_path: pathlib.Path, rank: int, names: list[str]
) -> None:
    manifest = _committed(tmp_path / "step", 4, FILES)
    assert [e.path for e in memtier.share_entries(manifest, rank)] == names


def test_keep_own_copies_the_share_with_an_index_and_drops_the_older(
    tmp_path: pathlib.Path,
) -> None:
    memdir = tmp_path / "mem"
    old = _committed(tmp_path / "v2", 2, FILES)
    memtier.keep_own(memdir=memdir, folder=tmp_path / "v2", manifest=old, rank=1)
    new = _committed(tmp_path / "v4", 4, FILES)
    kept = memtier.keep_own(memdir=memdir, folder=tmp_path / "v4", manifest=new, rank=1)
    assert memtier.own_steps(memdir) == [4]
    assert sorted(p.name for p in kept.iterdir()) == [
        ".metadata",
        "__1_0.distcp",
        memtier.INDEX,
        manifest_mod.MANIFEST_NAME,
    ]
    index = json.loads((kept / memtier.INDEX).read_text())
    assert index["step"] == 4 and index["rank"] == 1
    assert {f["path"]: f["crc32c"] for f in index["files"]} == {
        e.path: e.crc32c for e in memtier.share_entries(new, 1)
    }
    assert not list(memtier.own_root(memdir).glob(".*.tmp"))


def test_keep_own_replaces_a_recommitted_step(tmp_path: pathlib.Path) -> None:
    memdir = tmp_path / "mem"
    first = _committed(tmp_path / "a", 4, FILES)
    memtier.keep_own(memdir=memdir, folder=tmp_path / "a", manifest=first, rank=0)
    again = _committed(tmp_path / "b", 4, {**FILES, "__0_0.distcp": (0, b"other")})
    kept = memtier.keep_own(memdir=memdir, folder=tmp_path / "b", manifest=again, rank=0)
    assert (kept / "__0_0.distcp").read_bytes() == b"other"


def test_keep_own_failure_leaves_the_held_step(tmp_path: pathlib.Path) -> None:
    memdir = tmp_path / "mem"
    held = _committed(tmp_path / "a", 2, FILES)
    memtier.keep_own(memdir=memdir, folder=tmp_path / "a", manifest=held, rank=0)
    broken = _committed(tmp_path / "b", 4, FILES)
    (tmp_path / "b" / "__0_0.distcp").unlink()  # rotated away while the keeper lagged
    with pytest.raises(FileNotFoundError):
        memtier.keep_own(memdir=memdir, folder=tmp_path / "b", manifest=broken, rank=0)
    assert memtier.own_steps(memdir) == [2]
    assert not list(memtier.own_root(memdir).glob(".*.tmp"))


def _held(own: typing.Any, replica: typing.Any) -> dict[str, typing.Any]:
    return {"own": own, "replica": replica}


@pytest.mark.parametrize(
    ("reports", "step"),
    [
        ([_held([4], [4]), _held([4], [4])], 4),
        # rank 1 lost its memory: rank 0 holds its replica (rank 0's "replica" is rank 1's)
        ([_held([4], [4]), _held([], [4])], 4),
        # rank 1 lost its memory and rank 0 holds no replica of it
        ([_held([4], []), _held([], [4])], None),
        # ranks hold different steps: the newest common one
        ([_held([2, 4], [2]), _held([2], [2, 4])], 2),
        ([], None),
        ([_held([4], [4])], 4),  # one rank
        # malformed reports (another party's bytes in the store) hold nothing
        ([{"own": "4"}, _held([True, -1, 4], "4")], None),
    ],
)
def test_memory_step(reports: list[dict[str, typing.Any]], step: int | None) -> None:
    assert memrestore.memory_step(reports) == step


def test_memory_step_with_two_ranks_per_pod() -> None:
    """Pods of 2 ranks: rank r's replica is on rank r+2 (the next pod), so the
    pod of ranks 2 and 3 lost leaves their replicas on ranks 0 and 1."""
    pod_a = [_held([4], [4]), _held([4], [4])]  # hold the replicas of ranks 2 and 3
    lost = [_held([], []), _held([], [])]  # the other pod, with its memory, gone
    assert memrestore.memory_step([*pod_a, *lost], stride=2) == 4
    # with stride 1, rank 2's successor would be rank 3, lost with it
    assert memrestore.memory_step([*pod_a, *lost], stride=1) is None


@pytest.mark.parametrize(
    ("local", "world", "stride"),
    [
        (None, 4, 1),  # not under torchrun: no pod structure known
        ("2", 4, 2),  # two pods of two ranks
        ("4", 4, 1),  # one pod holds every rank: the next rank, in the same pod
        ("3", 4, 1),  # does not divide the world
        ("1", 4, 1),
        ("x", 4, 1),  # malformed
    ],
)
def test_ranks_per_pod(local: str | None, world: int, stride: int) -> None:
    env = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    assert memtier.ranks_per_pod(world, env) == stride


def test_successor_and_predecessor_are_inverse_and_cross_pods() -> None:
    world, stride = 6, 2
    for rank in range(world):
        after = memtier.successor(rank, world, stride)
        assert memtier.predecessor(after, world, stride) == rank
        assert after // stride != rank // stride  # never the rank's own pod


def test_ranks_of_one_pod_keep_their_copies_apart(tmp_path: pathlib.Path) -> None:
    """Two ranks on one memory volume each keep their own share under rank-<r>/."""
    vol = tmp_path / "vol" / "step"
    manifest = _committed(vol, 4, FILES)
    for rank in range(2):
        memtier.keep_own(
            memdir=memtier.rank_dir(tmp_path / "mem", rank),
            folder=vol,
            manifest=manifest,
            rank=rank,
        )
    for rank in range(2):
        index = memtier.own_folder(memtier.rank_dir(tmp_path / "mem", rank), 4) / memtier.INDEX
        assert json.loads(index.read_text())["rank"] == rank


def test_pod_env_turns_the_tier_on() -> None:
    env = {podenv.MEMORY_DIR: "/var/run/cairn/memory", podenv.MEMORY_REPLICAS: "0"}
    opts = runtime_config.from_env(env).checkpoint
    assert opts.memory_dir == pathlib.Path("/var/run/cairn/memory")
    assert opts.memory_replicas == 0


def test_memory_is_off_by_default_and_nothing_starts(tmp_path: pathlib.Path) -> None:
    opts = runtime_config.from_env({}).checkpoint
    assert opts.memory_dir is None and opts.memory_replicas == 1
    assert memtier.start(opts, coordinator=typing.cast(typing.Any, None), callbacks=()) is None


def test_replicas_must_be_zero_or_one(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="memory_replicas"):
        options.CheckpointOptions(directory=tmp_path, memory_dir=tmp_path, memory_replicas=2)


@pytest.mark.parametrize("barrier", [True, False])
def test_a_started_tier_keeps_steps_in_the_background_and_closes(
    tmp_path: pathlib.Path, barrier: bool
) -> None:
    opts = options.CheckpointOptions(
        directory=tmp_path / "vol", memory_dir=tmp_path / "mem", job_uid="u", manifest_keyring=RING
    )
    seen: list[events.ProgressEvent] = []
    tier = memtier.start(opts, coordinator=coordinator.LocalCoordinator(), callbacks=[seen.append])
    assert tier is not None and tier.addresses is not None and tier.peer_of(0) is None  # one rank
    manifest = _committed(tmp_path / "vol" / "step", 4, FILES)
    tier.committed(folder=tmp_path / "vol" / "step", manifest=manifest)
    tier.close(barrier=barrier)  # finishes the queued keep first
    assert memtier.own_steps(memtier.rank_dir(tmp_path / "mem", 0)) == [4]
    assert [(e.phase, e.step, e.message) for e in seen] == [("memory_kept", 4, "own")]


def test_advertised_host_is_the_route_to_the_master() -> None:
    assert memtier.advertised_host({"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"
    assert memtier.advertised_host({podenv.MASTER_ADDR_CAIRN: "127.0.0.1"}) == "127.0.0.1"
    assert memtier.advertised_host({"MASTER_ADDR": "no-such-host.invalid"})  # falls back


def test_peer_key_needs_the_keyring_and_uid(tmp_path: pathlib.Path) -> None:
    bare = options.CheckpointOptions(directory=tmp_path, memory_dir=tmp_path)
    assert memtier.peer_key(bare) is None
    keyed = options.CheckpointOptions(
        directory=tmp_path, memory_dir=tmp_path, job_uid="u", manifest_keyring=RING
    )
    key = memtier.peer_key(keyed)
    assert key is not None and key != RING.keys["k1"]  # derived, never the manifest key


def test_a_fetched_replica_is_checked_by_what_was_counted_on_arrival(
    tmp_path: pathlib.Path,
) -> None:
    manifest = _committed(tmp_path / "step", 4, FILES)
    share = memtier.share_entries(manifest, 0)
    counted = {e.path: (e.size, e.crc32c) for e in share}
    assert memrestore.received_problems(share, counted) == []
    meta, data = share
    wrong = {
        meta.path: counted[meta.path],
        data.path: (data.size, f"{int(data.crc32c, 16) ^ 1:08x}"),
    }
    assert [(p.path, p.reason.split()[0]) for p in memrestore.received_problems(share, wrong)] == [
        (data.path, "crc32c")
    ]
    short = {**counted, data.path: (data.size - 1, data.crc32c)}
    assert memrestore.received_problems(share, short)[0].reason.startswith("size")
    missing = {meta.path: counted[meta.path]}
    assert memrestore.received_problems(share, missing)[0].reason == "not in the replica"
