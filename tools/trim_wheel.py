"""Rewrite PyTriton's wheel for a Python 3.12 machine (`tools/gpu_machine_wheels.sh`): the other Pythons' backend
stubs and the libpython they bundle left out, one library replaced by another file, each entry's permissions kept.

    python tools/trim_wheel.py SOURCE.whl TARGET.whl MEMBER REPLACEMENT
"""

from __future__ import annotations

import re
import sys
import zipfile

DROPPED = re.compile(r"libpython3-[0-9a-f]+\.13\.so|python_backend_stubs/3\.(8|9|10|11|13)/")


def trim(source: str, target: str, member: str, replacement: str) -> None:
    """Write `target`: `source`'s entries less `DROPPED`, `member`'s contents from the file `replacement`, and the
    wheel's RECORD without the lines of the entries that changed or went."""
    with open(replacement, "rb") as stream:
        replaced = stream.read()
    with zipfile.ZipFile(source) as original, \
            zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as trimmed:
        for info in original.infolist():
            if DROPPED.search(info.filename):
                continue
            data = replaced if info.filename == member else original.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not DROPPED.search(line.decode()) and member.encode() not in line)
            trimmed.writestr(info, data)  # the ZipInfo carries the entry's mode (executables stay executable)


if __name__ == "__main__":
    trim(*sys.argv[1:5])
