"""The output directory, written whole or not at all: everything goes into a temporary
directory beside it, which is renamed onto the target at the end. A failed or interrupted run
leaves no directory behind, never a report without its figures or a half-written file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvtier_rs.rollout.errors import RolloutError


def check_out_dir(path: str, overwrite: bool) -> Path:
    """Refuse, before anything runs, an output directory that cannot be made or would be lost."""
    out = Path(path)
    parent = out.resolve().parent
    if not parent.is_dir():
        raise RolloutError(f"--out {path}: its parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise RolloutError(f"--out {path}: cannot write into {parent}")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise RolloutError(f"--out {path}: exists and is not a directory")
        if not overwrite:
            raise RolloutError(f"--out {path}: exists; give --overwrite to replace it")
    return out


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` for the block to fill; renamed onto `out` when the
    block ends (a directory already there is replaced: moved aside first, then removed), removed
    when it raises."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.resolve().parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; the output is an ordinary directory
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.resolve().parent))
            os.rename(out, old / out.name)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
