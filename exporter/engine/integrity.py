"""Engine file integrity: the manifest's inventory (size and sha256 of every file) and its checks at load.

Sizes and safetensors headers are checked at every load (cheap). Hashes are checked when asked, or by default when
the engine has not been verified in its current state: a verified check leaves a marker (`.verified`) keyed by the
manifest's bytes and every file's size and modification time, so rewriting or copying a file brings the check back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors import safe_open

from .errors import EngineError

MANIFEST = "manifest.json"
VERIFIED_MARKER = ".verified"
HASH_BLOCK_BYTES = 1 << 20
AGAIN = "export the checkpoint again"


def describe_files(model_dir: Path) -> dict[str, dict[str, Any]]:
    """`{relative path: {"size", "sha256"}}` of every file under `model_dir` but the manifest and the marker."""
    files = {}
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        name = path.relative_to(model_dir).as_posix()
        if name not in (MANIFEST, VERIFIED_MARKER):
            files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(HASH_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def check_files(model_dir: Path, manifest: dict[str, Any], verify: bool | None = None) -> None:
    """Raise an EngineError naming the first bad file: missing, wrong size, unreadable safetensors header, or
    (with `verify`; None: unless verified in this state before) a sha256 mismatch. A passed hash check leaves the
    marker."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise EngineError(f"{MANIFEST} lists no engine files; {AGAIN}")
    for name, record in files.items():
        path = _listed_path(model_dir, name)
        if not (isinstance(record, dict) and type(record.get("size")) is int and isinstance(record.get("sha256"), str)):
            raise EngineError(f"{MANIFEST} has no size and sha256 for {name}; {AGAIN}")
        if not path.is_file():
            raise EngineError(f"engine file {name} is missing; {AGAIN}")
        size, expected = path.stat().st_size, record["size"]
        if size < expected:
            raise EngineError(f"engine file {name} is truncated: {size} of {expected} bytes; {AGAIN}")
        if size != expected:
            raise EngineError(f"engine file {name} has {size} bytes, the manifest says {expected}; {AGAIN}")
    for name in files:
        if name.endswith(".safetensors"):
            _check_safetensors_header(model_dir / name, name)
    if verify is None:
        verify = _read_marker(model_dir) != _marker(model_dir, files)
    if not verify:
        return
    for name, record in files.items():
        if sha256_file(model_dir / name) != record["sha256"]:
            raise EngineError(f"engine file {name} is corrupt: sha256 mismatch; {AGAIN}")
    mark_verified(model_dir, files)


def mark_verified(model_dir: Path, files: dict[str, Any]) -> None:
    """Record that the engine's files passed the hash check in their current state (skipped where read-only)."""
    marker = model_dir / VERIFIED_MARKER
    staged = marker.with_name(f"{VERIFIED_MARKER}.{os.getpid()}")
    try:
        staged.write_text(json.dumps(_marker(model_dir, files)))
        os.replace(staged, marker)
    except OSError:
        staged.unlink(missing_ok=True)


def _listed_path(model_dir: Path, name: Any) -> Path:
    parts = PurePosixPath(str(name)).parts
    if not isinstance(name, str) or not parts or name.startswith("/") or ".." in parts or "\\" in name:
        raise EngineError(f"{MANIFEST} lists an invalid file name {name!r}; {AGAIN}")
    return model_dir / name


def _check_safetensors_header(path: Path, name: str) -> None:
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # safetensors raises its own error types, and OSError; each is one line here
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise EngineError(f"engine file {name} is not a readable safetensors file ({reason}); {AGAIN}") from None


def _marker(model_dir: Path, files: dict[str, Any]) -> dict[str, Any]:
    stamps = {}
    for name in files:
        stat = (model_dir / name).stat()
        stamps[name] = [stat.st_size, stat.st_mtime_ns]
    return {"manifest_sha256": sha256_file(model_dir / MANIFEST), "files": stamps}


def _read_marker(model_dir: Path) -> Any:
    try:
        return json.loads((model_dir / VERIFIED_MARKER).read_text())
    except (OSError, ValueError):
        return None
