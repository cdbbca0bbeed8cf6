"""A FUSE file system that loses everything not fsynced when the power is "cut".

Run as a process (`python powercut_fs.py MOUNTPOINT CONTROL_DIR`); tests use
`PowerCutMount`. Everything lives in memory, in two versions per inode:

- a file's bytes as written, and its bytes as of its last fsync (file fsync
  covers data only, not the name that points at it);
- a folder's entries as changed (create, mkdir, link, unlink, rename), and
  its entries as of its last fsync (folder fsync covers the entries, so a
  rename is durable once both parents were fsynced after it).

A cut (the test creates `CONTROL_DIR/cut`) replaces every inode's current
version with its durable one, so what stays reachable from the root is
exactly what the strictest POSIX reading promises after a power loss: a
file never fsynced is empty, a name never fsynced in its folder is gone.
The FS answers `CONTROL_DIR/cut.done` when done. The kernel is told to
cache nothing (direct I/O, zero entry/attribute timeouts), so after the cut
every read sees the durable state. Test helper, not product code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import os
import pathlib
import signal
import stat
import subprocess
import sys
import threading
import time
import typing

import mfusepy  # type: ignore[import-untyped]


@dataclasses.dataclass(eq=False)
class Inode:
    mode: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    durable_data: bytes = b""
    entries: dict[str, Inode] = dataclasses.field(default_factory=dict)
    durable_entries: dict[str, Inode] = dataclasses.field(default_factory=dict)
    mtime: float = dataclasses.field(default_factory=time.time)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


def _oserror(code: int) -> mfusepy.FuseOSError:
    return mfusepy.FuseOSError(code)


class PowerCutFS(mfusepy.Operations):  # type: ignore[misc]
    """The in-memory two-version file system (see the module docstring)."""

    use_ns = True

    def __init__(self) -> None:
        self.mutex = threading.RLock()
        self.root = Inode(mode=stat.S_IFDIR | 0o755)
        self.handles: dict[int, Inode] = {}
        self.next_fh = itertools.count(1)
        self.cuts = 0

    # -- the power cut -------------------------------------------------
    def cut(self) -> None:
        with self.mutex:
            seen: set[int] = set()
            stack = [self.root]
            while stack:
                node = stack.pop()
                if id(node) in seen:
                    continue
                seen.add(id(node))
                node.data = bytearray(node.durable_data)
                node.entries = dict(node.durable_entries)
                stack.extend(node.entries.values())
            self.handles.clear()
            self.cuts += 1

    # -- path resolution -----------------------------------------------
    def _lookup(self, path: str) -> Inode:
        node = self.root
        for part in (p for p in path.split("/") if p):
            if not node.is_dir or part not in node.entries:
                raise _oserror(errno.ENOENT)
            node = node.entries[part]
        return node

    def _parent(self, path: str) -> tuple[Inode, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self._lookup(head or "/")
        if not parent.is_dir:
            raise _oserror(errno.ENOTDIR)
        return parent, name

    def _node(self, path: str | None, fh: int | None) -> Inode:
        if fh and fh in self.handles:
            return self.handles[fh]
        if path is None:
            raise _oserror(errno.EBADF)
        return self._lookup(path)

    def _handle(self, node: Inode) -> int:
        fh = next(self.next_fh)
        self.handles[fh] = node
        return fh

    # -- metadata --------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, typing.Any]:
        with self.mutex:
            node = self._node(path, fh)
            ns = int(node.mtime * 1e9)
            return {
                "st_mode": node.mode,
                "st_nlink": 2 if node.is_dir else 1,
                "st_size": len(node.data),
                "st_uid": os.getuid(),
                "st_gid": os.getgid(),
                "st_mtime": ns,
                "st_ctime": ns,
                "st_atime": ns,
            }

    def readdir(self, path: str, fh: int) -> list[str]:
        with self.mutex:
            return [".", "..", *self._node(path, fh).entries]

    def statfs(self, path: str) -> dict[str, int]:
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 1 << 24,
            "f_bfree": 1 << 23,
            "f_bavail": 1 << 23,
            "f_files": 1 << 20,
            "f_ffree": 1 << 20,
            "f_namemax": 255,
        }

    def chmod(self, path: str, mode: int) -> int:
        with self.mutex:
            node = self._lookup(path)
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
            return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        with self.mutex:
            self._lookup(path).mtime = time.time()
            return 0

    def access(self, path: str, amode: int) -> int:
        with self.mutex:
            self._lookup(path)
            return 0

    # -- entries (durable only after the folder's fsync) ---------------
    def _add(self, path: str, node: Inode) -> None:
        parent, name = self._parent(path)
        if name in parent.entries:
            raise _oserror(errno.EEXIST)
        parent.entries[name] = node
        parent.mtime = time.time()

    def mkdir(self, path: str, mode: int) -> int:
        with self.mutex:
            self._add(path, Inode(mode=stat.S_IFDIR | (mode & 0o7777)))
            return 0

    def create(self, path: str, mode: int, fi: typing.Any = None) -> int:
        with self.mutex:
            node = Inode(mode=stat.S_IFREG | (mode & 0o7777))
            self._add(path, node)
            return self._handle(node)

    def link(self, target: str, source: str) -> int:
        with self.mutex:
            node = self._lookup(source)
            if node.is_dir:
                raise _oserror(errno.EPERM)
            self._add(target, node)
            return 0

    def unlink(self, path: str) -> int:
        with self.mutex:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise _oserror(errno.ENOENT)
            if node.is_dir:
                raise _oserror(errno.EISDIR)
            del parent.entries[name]
            return 0

    def rmdir(self, path: str) -> int:
        with self.mutex:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise _oserror(errno.ENOENT)
            if not node.is_dir:
                raise _oserror(errno.ENOTDIR)
            if node.entries:
                raise _oserror(errno.ENOTEMPTY)
            del parent.entries[name]
            return 0

    def rename(self, old: str, new: str) -> int:
        with self.mutex:
            old_parent, old_name = self._parent(old)
            new_parent, new_name = self._parent(new)
            node = old_parent.entries.get(old_name)
            if node is None:
                raise _oserror(errno.ENOENT)
            existing = new_parent.entries.get(new_name)
            if existing is node:
                return 0
            if existing is not None:
                if existing.is_dir and not node.is_dir:
                    raise _oserror(errno.EISDIR)
                if node.is_dir and not existing.is_dir:
                    raise _oserror(errno.ENOTDIR)
                if existing.is_dir and existing.entries:
                    raise _oserror(errno.ENOTEMPTY)
            del old_parent.entries[old_name]
            new_parent.entries[new_name] = node
            return 0

    # -- data (durable only after the file's fsync) ---------------------
    def open(self, path: str, flags: int) -> int:
        with self.mutex:
            node = self._lookup(path)
            if flags & os.O_TRUNC:
                node.data = bytearray()
            return self._handle(node)

    def opendir(self, path: str) -> int:
        with self.mutex:
            return self._handle(self._lookup(path))

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self.mutex:
            return bytes(self._node(path, fh).data[offset : offset + size])

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self.mutex:
            node = self._node(path, fh)
            if len(node.data) < offset:
                node.data.extend(b"\0" * (offset - len(node.data)))
            node.data[offset : offset + len(data)] = data
            node.mtime = time.time()
            return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self.mutex:
            node = self._node(path, fh)
            del node.data[length:]
            node.data.extend(b"\0" * (length - len(node.data)))
            return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self.mutex:
            node = self._node(path, fh)
            node.durable_data = bytes(node.data)
            return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self.mutex:
            node = self._node(path, fh)
            node.durable_entries = dict(node.entries)
            return 0

    def release(self, path: str, fh: int) -> int:
        with self.mutex:
            self.handles.pop(fh, None)
            return 0

    def releasedir(self, path: str, fh: int) -> int:
        return self.release(path, fh)

    def flush(self, path: str, fh: int) -> int:
        return 0


def _watch(fs: PowerCutFS, control: pathlib.Path) -> None:
    """Serve cuts: `control/cut` appears -> cut, answer `control/cut.done`."""
    request, done = control / "cut", control / "cut.done"
    while True:
        if request.exists() and not done.exists():
            fs.cut()
            done.write_text(str(fs.cuts))
        time.sleep(0.02)


def main() -> None:
    mountpoint, control = sys.argv[1], pathlib.Path(sys.argv[2])
    fs = PowerCutFS()
    threading.Thread(target=_watch, args=(fs, control), daemon=True).start()
    (control / "ready").write_text(str(os.getpid()))
    mfusepy.FUSE(
        fs,
        mountpoint,
        foreground=True,
        direct_io=True,
        entry_timeout=0,
        attr_timeout=0,
        negative_timeout=0,
        hard_remove=True,
        fsname="powercut",
    )


@dataclasses.dataclass(kw_only=True)
class PowerCutMount:
    """A running `powercut_fs` process mounted at `path` (bounded waits)."""

    path: pathlib.Path
    control: pathlib.Path
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, base: pathlib.Path) -> PowerCutMount:
        path, control = base / "mnt", base / "control"
        path.mkdir(parents=True)
        control.mkdir()
        with (base / "powercut_fs.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__, str(path), str(control)], stdout=log, stderr=log
            )
        mount = cls(path=path, control=control, proc=proc)
        deadline = time.monotonic() + 30
        while not os.path.ismount(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                mount.stop()
                raise RuntimeError(
                    f"powercut FUSE did not mount at {path}: "
                    + (base / "powercut_fs.log").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.05)
        return mount

    def cut(self) -> None:
        """Drop everything not fsynced (call with every writer dead)."""
        done = self.control / "cut.done"
        done.unlink(missing_ok=True)
        (self.control / "cut").write_text("")
        deadline = time.monotonic() + 30
        while not done.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("powercut FUSE did not answer the cut in 30 s")
            time.sleep(0.02)
        (self.control / "cut").unlink()

    def stop(self) -> None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], timeout=30, check=False)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


if __name__ == "__main__":
    main()
