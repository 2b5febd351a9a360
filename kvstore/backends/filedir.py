"""One file per value in a directory tree, written crash-safely; shared by ``ssd`` and ``fs``.

Directory layout: ``<root>/<key[:2]>/<key>.kv`` (256-way fan-out for hex keys). Writers create
``<root>/<key[:2]>/.<key>.<host>.<pid>.<random>.tmp``, write and (optionally) fsync it, then
``os.replace`` it onto the final name. A rename within one directory is atomic on POSIX local and
shared filesystems, so a reader sees the old file or the new one, never a mix, and concurrent
writers of one key (threads, processes, hosts) each publish a whole file: the last rename wins.

File layout (little-endian)::

    offset  size  field
    0       4     magic b"DSKF"
    4       4     flags: bit 0 = the crc32 field is valid
    8       8     n: value length in bytes (u64)
    16      4     crc32 (zlib) of the value, or 0
    20      4     reserved, 0
    24      n     value

A file whose size is not ``24 + n``, whose magic is wrong, or (with ``checksum``) whose crc32 does
not match is a torn or damaged write: it is reported as an error, deleted, and read as a miss.
Temp files left by a crash are never read (readers only open ``*.kv``) and are swept at start-up
once older than ``stale_tmp_s``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from kvstore.backends.base import Backend
from kvstore.errors import BackendFull, InvalidKey

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sIQII")  # magic, flags, length, crc32, reserved
_MAGIC = b"DSKF"
_FLAG_CRC = 1
_SUFFIX = ".kv"
_KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DirectoryBackend(Backend):
    """Values as checksummed files under ``root``; see the module docstring for the layout.

    ``checksum``: compute and verify a crc32 of each value in the file frame. The tiered store
    turns it off because every record already carries its own crc32 that the store verifies; the
    frame's length check still catches truncation. ``fsync``: fsync each file before the rename
    (and its directory after, with ``fsync_dir``) so a power loss cannot leave a torn final file.
    """

    kind = "dir"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        checksum: bool = True,
        fsync: bool = True,
        fsync_dir: bool = True,
        stale_tmp_s: float = 600.0,
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # KV holds users' prompts: owner only
        self.checksum = checksum
        self.fsync = fsync
        self.fsync_dir = fsync_dir
        self._tag = f"{socket.gethostname()}.{os.getpid()}"
        self._lock = threading.Lock()
        self._sweep_tmp(stale_tmp_s)
        self._used = sum(n for _, n in self.entries())

    # --- paths -------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not _KEY_RE.fullmatch(key):
            raise InvalidKey(f"key {key!r} is not a safe file name")
        return self.root / key[:2] / (key + _SUFFIX)

    def _sweep_tmp(self, older_than_s: float) -> None:
        cutoff = time.time() - older_than_s
        for tmp in self.root.glob("*/.*.tmp"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass  # another process swept or renamed it

    # --- interface ---------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                frame = f.read(_FRAME.size)
                if len(frame) == _FRAME.size:
                    magic, flags, n, crc, _ = _FRAME.unpack(frame)
                    if magic == _MAGIC and st.st_size == _FRAME.size + n:
                        value = f.read(n)
                        if len(value) == n and not (self.checksum and flags & _FLAG_CRC and zlib.crc32(value) != crc):
                            return value
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kvstore %s: read of %s failed: %s", self.kind, path, exc)
            self._report_error("get", exc)
            return None
        self._drop_damaged(path, st.st_ino)
        return None

    def _drop_damaged(self, path: Path, ino: int) -> None:
        """Delete a torn/damaged file, unless a writer has just replaced it with a new one."""
        self._report_error("corrupt", ValueError(f"torn or damaged file {path}"))
        try:
            if os.stat(path).st_ino == ino:
                size = os.stat(path).st_size
                path.unlink()
                with self._lock:
                    self._used -= max(size - _FRAME.size, 0)
        except OSError:
            pass

    def put(self, key: str, value: bytes) -> bool:
        path = self._path(key)
        n = len(value)
        crc = zlib.crc32(value) if self.checksum else 0
        frame = _FRAME.pack(_MAGIC, _FLAG_CRC if self.checksum else 0, n, crc, 0)
        tmp = path.parent / f".{key}.{self._tag}.{secrets.token_hex(4)}.tmp"
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(frame)
                f.write(value)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            old = self._file_value_size(path)
            os.replace(tmp, path)
            if self.fsync and self.fsync_dir:
                self._fsync_dir(path.parent)
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            if exc.errno in _FULL_ERRNOS:
                raise BackendFull(f"{self.root}: {exc}") from exc
            log.warning("kvstore %s: write of %s failed: %s", self.kind, path, exc)
            self._report_error("put", exc)
            return False
        with self._lock:
            self._used += n - old
        return True

    @staticmethod
    def _file_value_size(path: Path) -> int:
        try:
            return max(path.stat().st_size - _FRAME.size, 0)
        except OSError:
            return 0

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, key: str) -> bool:
        path = self._path(key)
        size = self._file_value_size(path)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._report_error("remove", exc)
            return False
        with self._lock:
            self._used -= size
        return True

    def entries(self) -> Iterator[tuple[str, int]]:
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            try:
                with os.scandir(sub) as it:
                    for e in it:
                        if e.name.endswith(_SUFFIX) and not e.name.startswith("."):
                            try:
                                size = e.stat().st_size
                            except OSError:
                                continue  # removed meanwhile
                            yield e.name[: -len(_SUFFIX)], max(size - _FRAME.size, 0)
            except FileNotFoundError:
                continue

    def used_bytes(self) -> int:
        return self._used
