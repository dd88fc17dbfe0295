"""Engine file integrity: the manifest's inventory (size and sha256 of every file) and its checks at load.

Sizes and safetensors headers are checked at every load (cheap). Hashes are checked when asked, or by default when
the engine has not been verified in its current state: a verified check leaves a marker (`.verified`) keyed by the
manifest's bytes and every file's size and modification time, so rewriting or copying a file brings the check back.
Files are hashed in parallel; a file the loader reads anyway (the LLM weights) is hashed as it streams
(`HashCheck`), not read twice. Files under `.cache/` (kernel choices and compiled kernels, `kernel_cache`) are no
part of the engine: the inventory never lists them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors import safe_open

from .errors import EngineError

MANIFEST = "manifest.json"
VERIFIED_MARKER = ".verified"
CACHE_DIR = ".cache"
HASH_BLOCK_BYTES = 8 << 20
HASHERS = 4
AGAIN = "export the checkpoint again"


def describe_files(model_dir: Path, known: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """`{relative path: {"size", "sha256"}}` of every engine file under `model_dir` (not the manifest, the marker
    or `.cache/`); `known` gives the sha256 of files hashed as they were written."""
    known = known or {}
    paths = {path.relative_to(model_dir).as_posix(): path for path in sorted(model_dir.rglob("*")) if path.is_file()}
    names = [name for name in paths if name not in (MANIFEST, VERIFIED_MARKER) and name.split("/")[0] != CACHE_DIR]
    with ThreadPoolExecutor(HASHERS, thread_name_prefix="engine-hash") as pool:
        hashes = {name: pool.submit(sha256_file, paths[name]) for name in names if name not in known}
        return {name: {"size": paths[name].stat().st_size,
                       "sha256": known[name] if name in known else hashes[name].result()} for name in names}


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """Hex sha256 of a file's bytes, read in blocks ("" when `stop` is set before the end)."""
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as stream:
        block = bytearray(HASH_BLOCK_BYTES)
        view = memoryview(block)
        while got := stream.readinto(block):
            if stop is not None and stop.is_set():
                return ""
            digest.update(view[:got])
    return digest.hexdigest()


def check_files(model_dir: Path, manifest: dict[str, Any], verify: bool | None = None,
                streamed: Collection[str] = ()) -> HashCheck | None:
    """Raise an EngineError naming the first bad file: missing, wrong size, unreadable safetensors header, or
    (with `verify`; None: unless verified in this state before) a sha256 mismatch. A passed hash check leaves the
    marker.

    The hashes of the `streamed` files are left to the caller, who reads them anyway: when hashes are due, the
    returned `HashCheck` gives their digests to feed and is finished by the caller once they are read (the other
    files are hashed meanwhile, in the background). None when no hash check is due."""
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
        return None
    check = HashCheck(model_dir, files, [name for name in streamed if name in files])
    if not check.digests:
        check.finish()
        return None
    return check


class HashCheck:
    """A hash check under way: the files not streamed are hashed on threads; `digests` are the streamed files'
    hashlib objects, to be fed their bytes in order; `finish()` compares everything and leaves the marker."""

    def __init__(self, model_dir: Path, files: dict[str, Any], streamed: Collection[str]):
        self.model_dir, self.files = model_dir, files
        self.digests = {name: hashlib.sha256() for name in streamed}
        pool = ThreadPoolExecutor(HASHERS, thread_name_prefix="engine-hash")
        self._hashed: dict[str, Future] = {name: pool.submit(sha256_file, model_dir / name)
                                           for name in files if name not in self.digests}
        pool.shutdown(wait=False)

    def finish(self) -> None:
        """Raise an EngineError naming the first file whose sha256 does not match; mark the engine verified."""
        for name, record in self.files.items():
            actual = self.digests[name].hexdigest() if name in self.digests else self._hashed[name].result()
            if actual != record["sha256"]:
                raise EngineError(f"engine file {name} is corrupt: sha256 mismatch; {AGAIN}")
        mark_verified(self.model_dir, self.files)


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
