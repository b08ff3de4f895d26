"""pip's RECORD of the installed package: the list of its files that `pip uninstall` removes.

An overlay that creates files without listing them here would leave them behind when sglang is
uninstalled or upgraded, inside the next release's tree. So a plan rewrites RECORD alongside the
overlay's files: a row `path,sha256=<urlsafe base64, unpadded>,size` (PEP 376 / the wheel spec) for
each file it writes or creates. Every other line is kept byte for byte, and a rollback restores the
file like any other.
"""

from __future__ import annotations

import base64
import bisect
import csv
import hashlib
import io
import re


def record_path(base_version: str) -> str:
    """Package-relative path of the RECORD that pip wrote for sglang `base_version`."""
    return f"sglang-{base_version}.dist-info/RECORD"


def updated_record(record: bytes, contents: dict[str, bytes]) -> bytes:
    """`record` with the row of each path in `contents` replaced, or added where it sorts (pip writes
    its rows sorted by path; an unsorted RECORD gets the new rows at its end)."""
    text = record.decode("utf-8", "surrogateescape")  # bytes that are not UTF-8 pass through unchanged
    lines = [line if line.endswith("\n") else line + "\n" for line in re.findall(r"[^\n]*\n|[^\n]+$", text)]
    paths = [_path_of(line.rstrip("\r\n")) for line in lines]
    fresh = {path: _row(path, data) + "\n" for path, data in contents.items()}
    lines = [fresh.pop(path, line) for path, line in zip(paths, lines, strict=True)]
    in_order = paths == sorted(paths)
    for path, line in sorted(fresh.items()):
        at = bisect.bisect(paths, path) if in_order else len(paths)
        paths.insert(at, path)
        lines.insert(at, line)
    return "".join(lines).encode("utf-8", "surrogateescape")


def _path_of(line: str) -> str:
    if line.startswith('"'):  # quoted by csv: the path holds a comma or a quote
        return next(csv.reader([line]), [""])[0]
    return line.split(",", 1)[0]


def _row(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow([path, f"sha256={digest}", len(data)])
    return out.getvalue()
