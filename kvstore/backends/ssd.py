"""Local SSD directory: the capacity tier of one worker, durable across restarts.

Files written crash-safely (temp file + fsync + atomic rename + directory fsync; layout in
``kvstore.backends.filedir``). A full disk raises ``BackendFull`` so the tier evicts and retries;
the tier also keeps the directory under its byte budget. One worker owns the directory, so the
byte count kept here is exact apart from files other processes add.
"""

from __future__ import annotations

import os

from kvstore.backends.filedir import DirectoryBackend


class SSDBackend(DirectoryBackend):
    """A worker-local directory on an SSD."""

    kind = "ssd"

    def __init__(self, root: str | os.PathLike[str], *, checksum: bool = True, fsync: bool = True) -> None:
        super().__init__(root, checksum=checksum, fsync=fsync, fsync_dir=True, stale_tmp_s=60.0)
