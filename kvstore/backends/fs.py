"""A plain directory on a shared filesystem mount (NFS, CephFS, a 3FS FUSE mount).

Many workers on many hosts read and write the same tree. Safety for concurrent writers of one key
comes from the temp-file + rename protocol in ``kvstore.backends.filedir``: temp names carry host,
pid and a random tag, and live in the final file's directory so the rename never crosses a
filesystem. Directory fsync is off (several network filesystems reject or ignore it) and temp
files are swept only after an hour, since another host may still be writing them. ``used_bytes``
counts this process's view of the tree at start-up plus its own writes.
"""

from __future__ import annotations

import os

from kvstore.backends.filedir import DirectoryBackend


class FSBackend(DirectoryBackend):
    """A directory shared by several processes or hosts."""

    kind = "fs"

    def __init__(self, root: str | os.PathLike[str], *, checksum: bool = True, fsync: bool = True) -> None:
        super().__init__(root, checksum=checksum, fsync=fsync, fsync_dir=False, stale_tmp_s=3600.0)
