"""Hostile and tampered `.nemo` contents: pickle streams assembled opcode by opcode (each would call `module.name`
with one argument if unpickled), and a copy of a tar archive with one member replaced."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

METADATA = "model_weights/.metadata"  # the torch_dist layout's pickled metadata member


def unicode_op(value: str) -> bytes:
    """The BINUNICODE opcode pushing `value`."""
    data = value.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def short_unicode_op(value: str) -> bytes:
    """The SHORT_BINUNICODE opcode pushing `value` (under 256 bytes)."""
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def via_global(module: str, name: str, arg: str) -> bytes:
    """Protocol 2: GLOBAL module name; (arg,); REDUCE."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"(" + unicode_op(arg) + b"tR."


def via_stack_global(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: STACK_GLOBAL from two strings; TUPLE1; REDUCE."""
    return b"\x80\x04" + short_unicode_op(module) + short_unicode_op(name) + b"\x93" + short_unicode_op(arg) + b"\x85R."


def via_inst(module: str, name: str, arg: str) -> bytes:
    """Protocol 0: MARK arg INST module name (calls the class or function with the arguments)."""
    return b"(" + unicode_op(arg) + b"i" + f"{module}\n{name}\n".encode() + b"."


def via_obj(module: str, name: str, arg: str) -> bytes:
    """Protocol 1: MARK GLOBAL arg OBJ."""
    return b"(c" + f"{module}\n{name}\n".encode() + unicode_op(arg) + b"o."


def replace_member(source: Path, target: Path, name: str, data: bytes) -> Path:
    """A copy of tar `source` with member `name` (without its `./`) holding `data`."""
    with tarfile.open(source) as src, tarfile.open(target, "w") as dst:
        for member in src.getmembers():
            if member.name.removeprefix("./") == name:
                member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
            else:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return target
