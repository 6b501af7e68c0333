"""Writing the planner's output files whole or not at all, never through a planted link."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[BinaryIO]:
    """A new temporary file beside `path`, open for binary writing, for the block to fill; synced
    and renamed onto `path` when the block ends, removed if it raises. Written in place, a
    failure midway (a full disk) left a file cut off inside a record or a figure, and the one
    that was there before destroyed.

    No link is ever followed: the temporary is created with O_EXCL (mkstemp), written and
    chmodded through its descriptor only (its name is never opened again, so nobody who can
    write the directory can swap it for a link meanwhile; a temporary found swapped at the end is
    an OSError, not renamed), and the rename replaces whatever is at `path`, a link included,
    instead of writing where it points."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes it 0600; the output is an ordinary file
            os.fsync(f.fileno())
            mine, named = os.fstat(f.fileno()), os.lstat(tmp)
            if (named.st_dev, named.st_ino) != (mine.st_dev, mine.st_ino):
                # Swapped (for a link, say) by someone who can write the directory: renaming it
                # would put their file at `path`.
                raise OSError(errno.EEXIST, f"{tmp} was replaced while it was written; not renaming it")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_stream(path: Path) -> bool:
    """Whether `path` is a stream to write into where it is (a FIFO, a terminal, /dev/stdout and
    the character devices it may name) rather than a file to replace. Anything else, a link to a
    regular file or to a block device included, is replaced by a new file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
