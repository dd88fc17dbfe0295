"""Read-only access to the files of a `.nemo` tar (plain or gzip) or folder; unsafe members are refused."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import tarfile
import zlib
from pathlib import Path
from typing import IO


class NemoCheckpointError(Exception):
    """A checkpoint cannot be read: the message names the file or member and what is wrong."""


class Archive:
    """Read-only access to the files of a `.nemo` tar or folder by normalised name (no leading `./`)."""

    def __init__(self, path: Path):
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if not path.exists():
            raise NemoCheckpointError(f"{path}: no such file or folder")
        if path.is_dir():
            self.names = sorted(str(Path(folder, f).relative_to(path)) for folder, _, files in os.walk(path)
                                for f in files)
            return
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 (open until close())
            members = self._tar.getmembers()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            raise NemoCheckpointError(f"{path}: not a readable .nemo archive (tar or tar.gz): {err}") from err
        compressed = not isinstance(self._tar.fileobj, io.BufferedReader)
        for member in members:
            _check_member(path, member)
            if not compressed and member.offset_data + member.size > path.stat().st_size:
                raise NemoCheckpointError(f"{path}: the archive is truncated inside member {member.name!r}")
            if member.isfile():
                self._members[_normalise(member.name)] = member
        self.names = sorted(self._members)

    def open(self, name: str) -> IO[bytes]:
        """A seekable binary file object for member `name`."""
        if self._tar is None:
            return open(self._folder_file(name), "rb")
        if name not in self._members:
            raise NemoCheckpointError(f"{self.path}: no member {name!r}")
        return self._tar.extractfile(self._members[name])

    def span(self, name: str) -> tuple[Path, int, int] | None:
        """Where member `name`'s bytes lie: (file, offset, length), for a reader with a file handle of its own (one
        thread's reads then never move another's position); None inside a compressed tar or for a sparse member."""
        if self._tar is None:
            target = self._folder_file(name)
            return target, 0, target.stat().st_size
        if name not in self._members:
            raise NemoCheckpointError(f"{self.path}: no member {name!r}")
        member = self._members[name]
        if not isinstance(self._tar.fileobj, io.BufferedReader) or member.issparse():
            return None
        return self.path, member.offset_data, member.size

    def read(self, name: str) -> bytes:
        """All bytes of member `name`."""
        with self.open(name) as handle, reading(self.path, name):
            return handle.read()

    def _folder_file(self, name: str) -> Path:
        target = (self.path / name).resolve()
        if not target.is_relative_to(self.path.resolve()):
            raise NemoCheckpointError(f"{self.path}: {name!r} points outside the checkpoint folder")
        return target

    def close(self) -> None:
        """Close the tar file (a folder holds nothing open)."""
        if self._tar is not None:
            self._tar.close()


def _normalise(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def _check_member(path: Path, member: tarfile.TarInfo) -> None:
    """Refuse members that could escape or misuse an extraction: absolute, `..`, links, devices, fifos."""
    problem = None
    if member.name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", member.name):
        problem = "has an absolute path"
    elif ".." in re.split(r"[\\/]", member.name):
        problem = "contains '..'"
    elif member.issym() or member.islnk():
        problem = f"is a link (to {member.linkname!r})"
    elif member.isdev():
        problem = "is a device file or fifo"
    elif not (member.isfile() or member.isdir()):
        problem = "is not a regular file or folder"
    if problem:
        raise NemoCheckpointError(f"{path}: refusing unsafe archive member {member.name!r}: it {problem}")


@contextlib.contextmanager
def reading(path: Path, name: str):
    """Turn low-level read failures inside the block into a NemoCheckpointError naming the member."""
    try:
        yield
    except NemoCheckpointError:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error, RuntimeError, pickle.UnpicklingError) as err:
        raise NemoCheckpointError(
            f"{path}: cannot read member {name!r} (truncated, corrupt or not a weights file): {err}"
        ) from err
