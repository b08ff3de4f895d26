"""pip's RECORD as a plan rewrites it: rows replaced or added in place, every other byte kept."""

from __future__ import annotations

import base64
import csv
import hashlib
import io

from ddtree_deploy.record import record_path, updated_record

RECORD = (  # sorted by path, as pip writes it
    b"sglang-0.5.17.dist-info/RECORD,,\n"
    b'"sglang/kernels/lora,K=1024.json",sha256=AAAA,528\n'
    b"sglang/srt/a.py,sha256=BBBB,10\n"
    b"sglang/srt/speculative/__pycache__/x.cpython-311.pyc,,\n"
    b"sglang/srt/speculative/x.py,sha256=CCCC,3\n"
)


def rows(record: bytes) -> dict[str, list[str]]:
    return {row[0]: row for row in csv.reader(io.StringIO(record.decode()))}


def pip_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def test_a_written_file_gets_its_new_hash_and_size_in_place() -> None:
    out = updated_record(RECORD, {"sglang/srt/a.py": b"patched!"})
    assert rows(out)["sglang/srt/a.py"] == ["sglang/srt/a.py", pip_hash(b"patched!"), "8"]
    before, after = RECORD.decode().splitlines(), out.decode().splitlines()
    assert len(after) == len(before) and [a for a, b in zip(after, before, strict=True) if a != b] == [after[2]]


def test_created_files_are_listed_where_pip_would_sort_them_and_the_rest_is_byte_exact() -> None:
    source = b"x = 1\n"
    out = updated_record(RECORD, {"sglang/srt/speculative/ddtree.py": source, "sglang/srt/b,c.py": b""})
    lines = out.decode().splitlines()
    assert lines[3] == f'"sglang/srt/b,c.py",{pip_hash(b"")},0'  # a comma in a path is quoted, as pip does
    assert lines[5] == f"sglang/srt/speculative/ddtree.py,{pip_hash(source)},6"
    assert [line for line in lines if "ddtree" not in line and "b,c" not in line] == RECORD.decode().splitlines()


def test_an_unsorted_record_gets_new_rows_at_its_end() -> None:
    unsorted = b"z.py,sha256=A,1\na.py,sha256=B,1\n"
    assert updated_record(unsorted, {"m.py": b"m"}).decode().splitlines() == [
        "z.py,sha256=A,1", "a.py,sha256=B,1", f"m.py,{pip_hash(b'm')},1"]


def test_the_record_of_a_release_sits_in_its_dist_info() -> None:
    assert record_path("0.5.17") == "sglang-0.5.17.dist-info/RECORD"


def test_line_endings_of_untouched_rows_are_kept() -> None:
    crlf = b"a.py,sha256=A,1\r\nb.py,sha256=B,1\r\n"
    assert updated_record(crlf, {"b.py": b"b"}) == f"a.py,sha256=A,1\r\nb.py,{pip_hash(b'b')},1\n".encode()


def test_bytes_that_are_not_utf8_and_a_missing_last_newline_survive() -> None:
    odd = b"caf\xe9.py,sha256=A,1\nz.py,sha256=Z,1"
    assert updated_record(odd, {"m.py": b"m"}) == (
        b"caf\xe9.py,sha256=A,1\n" + f"m.py,{pip_hash(b'm')},1\n".encode() + b"z.py,sha256=Z,1\n")
