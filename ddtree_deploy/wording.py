"""How counts and times read in messages: "1 patch", "3 files"; a moment as ISO-8601 UTC with its age;
a running time.

Any module may word its messages with these (they format no rich markup and import nothing of ours).
"""

from __future__ import annotations

import time


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`1 file`, `3 files`, `1 patch`, `2 patches`; `many` for an irregular noun (`plural(n, "entry", "entries")`)."""
    if count == 1:
        return f"1 {noun}"
    if many is None:
        many = noun + ("es" if noun.endswith(("s", "x", "z", "ch", "sh")) else "s")
    return f"{count} {many}"


def moment(epoch_s: float, now: float | None = None) -> str:
    """`2026-12-01T10:41:32Z (5 min ago)`: a time a person can read, and how long ago it was."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))
    ago = (time.time() if now is None else now) - epoch_s
    return f"{stamp} ({duration(ago)} ago)" if ago >= 0 else f"{stamp} (in {duration(-ago)})"


def duration(seconds: float) -> str:
    """`42 s`, `3 min`, `5 h`, `2 days`: rounded to the unit that reads best."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h"
    return plural(round(seconds / 86400), "day")


def elapsed(seconds: float) -> str:
    """`42 s`, `1 min 42 s`, `1 h 05 min`: a running time, to the second while that matters."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
