"""Atomic export: the engine is built and validated in a staging folder, then swapped in by renames.

The staging folder lies inside the target folder, so the renames never cross a filesystem (the target may be a
mount point). A failed or interrupted export removes its staging folder and leaves the previous engine and every
other file untouched. Only the previous engine's own entries (those its manifest lists, with the manifest and the
verified marker) are replaced; a folder that holds files but no engine is refused. The kernel cache (`.cache/`)
is kept: its entries are keyed by GPU, software and weight shapes, so they stay valid for the new engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import EngineError
from .integrity import CACHE_DIR, MANIFEST, VERIFIED_MARKER

#: The top-level entries of a format-1 engine, whose manifest had no file inventory.
FORMAT1_ENTRIES = (MANIFEST, "llm_engine", "visual_engine", "perception_engine")
STAGING_PREFIX = ".export-"
REPLACED_PREFIX = ".replaced-"


def previous_engine(model_dir: Path, delete_existing_files: bool) -> list[str]:
    """Top-level names of the engine already in `model_dir` (to be replaced); [] for an empty or new folder.

    Refuses a folder holding files but no engine, whatever `delete_existing_files` says, and an engine when it is
    False (NeMo's behaviour).
    """
    if not model_dir.exists():
        return []
    if not model_dir.is_dir():
        raise EngineError(f"{model_dir} is a file; give a folder for the engine")
    present = {p.name for p in model_dir.iterdir()
               if not p.name.startswith((STAGING_PREFIX, REPLACED_PREFIX)) and p.name != CACHE_DIR}
    if not present:
        return []
    if MANIFEST not in present:
        raise EngineError(
            f"There are files in this folder ({model_dir}), but no engine ({MANIFEST} is missing), so nothing in it "
            "is replaced: export into an empty or new folder, or into one holding an engine exported before"
        )
    if not delete_existing_files:
        raise EngineError(f"There are files in this folder ({model_dir}). Try setting delete_existing_files=True.")
    try:
        files = json.loads((model_dir / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError) as err:
        raise EngineError(
            f"{model_dir / MANIFEST} is unreadable ({err}), so the engine's files are unknown: export into a new "
            "folder, or remove the old engine by hand"
        ) from None
    names = {str(name).split("/")[0] for name in files} | {MANIFEST} if isinstance(files, dict) else FORMAT1_ENTRIES
    return sorted(present & {*names, VERIFIED_MARKER})


@contextlib.contextmanager
def staging_folder(model_dir: Path) -> Iterator[Path]:
    """A new folder inside `model_dir` to build the engine in; removed on exit, with `model_dir` if this made it
    and it holds nothing else (the export failed; a kernel cache it began there is removed too)."""
    created = not model_dir.exists()
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=model_dir))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                if [entry.name for entry in model_dir.iterdir()] == [CACHE_DIR]:
                    shutil.rmtree(model_dir / CACHE_DIR)
                model_dir.rmdir()  # only when empty: the export failed


def install(staging: Path, model_dir: Path, previous: list[str]) -> None:
    """Replace the `previous` engine entries of `model_dir` by the entries of `staging`, by renames.

    The old manifest goes first and the new one last, so a folder caught half-way is no engine. Any failure
    (or interrupt) moves everything back before it propagates.
    """
    new = sorted((p.name for p in staging.iterdir()), key=lambda name: name == MANIFEST)
    blocking = [name for name in new if name not in previous and os.path.lexists(model_dir / name)]
    if blocking:
        raise EngineError(f"{model_dir / blocking[0]} is not part of the engine there but has an engine file's "
                          "name; move it away and export again")
    replaced = Path(tempfile.mkdtemp(prefix=REPLACED_PREFIX, dir=model_dir))
    moved_old: list[str] = []
    moved_new: list[str] = []
    try:
        for name in sorted(previous, key=lambda name: name != MANIFEST):
            os.replace(model_dir / name, replaced / name)
            moved_old.append(name)
        for name in new:
            os.replace(staging / name, model_dir / name)
            moved_new.append(name)
    except BaseException:
        for name in reversed(moved_new):
            os.replace(model_dir / name, staging / name)
        for name in reversed(moved_old):
            os.replace(replaced / name, model_dir / name)
        replaced.rmdir()
        raise
    shutil.rmtree(replaced, ignore_errors=True)
