"""What a path that is not a regular file is, for one-line messages (the trace and dump readers
open regular files only: a FIFO blocks, a device such as /dev/zero may never end)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """'a FIFO', 'a character device', ... of an `st_mode` that is not a regular file's."""
    return next((what for test, what in _KINDS if test(mode)), "not a plain file")


def describe(path: Path) -> str:
    """`file_kind` of what `path` leads to, and the link's target when it is a symbolic link."""
    try:
        kind = file_kind(os.stat(path).st_mode)
    except OSError:
        return "a broken link" if path.is_symlink() else "unreadable"
    if path.is_symlink():
        target = os.path.realpath(path)
        kind += f", through a link to {target if len(target) <= 200 else target[:197] + '...'}"
    return kind
