"""Atomic outputs: a file or folder appears whole under its final name, or not at all.

Every stage writes through these, so a killed job never leaves half a result behind for
Snakemake (or a person) to mistake for a finished one.
"""

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path


def _temp_sibling(dest: Path) -> Path:
    """An unused hidden name next to dest, on the same filesystem so a rename is atomic."""
    return dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")


def remove_stale_temps(dest) -> None:
    """Remove the temp siblings of dest that a killed writer left behind (``.<name>.<8
    chars>.tmp``: ours, and tempfile's with suffix ".tmp"). Only the one job that makes dest
    writes them, and it calls this before it starts, so none of them is in use."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.[A-Za-z0-9_]{{8}}\.tmp")
    for tmp in dest.parent.iterdir():
        if pattern.fullmatch(tmp.name):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


@contextmanager
def atomic_file(dest: Path):
    """Yield a temp path to write; it becomes dest only if the block succeeds."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)
    tmp = _temp_sibling(dest)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(dest: Path):
    """Yield an empty temp dir to fill; it replaces dest only if the block succeeds."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)
    tmp = _temp_sibling(dest)
    tmp.mkdir()
    try:
        yield tmp
        if dest.exists():
            # os.replace cannot overwrite a non-empty dir: move the old one aside first.
            old = _temp_sibling(dest)
            os.rename(dest, old)
            os.rename(tmp, dest)
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(obj, path) -> None:
    """obj as indented JSON at path, atomically (atomic_file)."""
    with atomic_file(Path(path)) as tmp:
        tmp.write_text(json.dumps(obj, indent=2))
