"""Where a greedy answer parts from its reference, and whether a near-tie of the reference explains it.

A bf16 server's numerics change with the batch shape: a verify forward over S tokens and a one-token
decode can pick different tokens where the target's best log-probs are within rounding of each other;
SGLang's own DFLASH, with no overlay, parted from plain decoding on 7 of 16 answers of a trained bf16
pair (run 15 in docs/gpu-validation.md). A split is a `near_tie` when the token taken is among the
reference's `TOP_TOKENS` best at that position and its log-prob is within `tolerance` nats of the
reference's choice; anything else is a `mismatch`, and so is every split the reference recorded no
log-probs for. Five, not two: in run 18 SGLang's own DFLASH took a token outside plain's recorded
two at a position where its batch-1 answer took the runner-up; a three-way bf16 tie there is the
likely cause, not yet shown (that run recorded two).
Tokens after a split are never compared (the two contexts differ from there on).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

#: nats; DFLASH's splits on the all-experts bf16 hybrid had top-2 gaps of 0.0-0.5 (shared/GPU.md)
DEFAULT_TIE_TOLERANCE = 0.5
#: how many of the reference's best tokens per position are recorded and may explain a split
TOP_TOKENS = 5
#: what a `/generate` request adds (top-level fields) to get the per-position top log-probs
LOGPROB_REQUEST: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": TOP_TOKENS}

#: per output position, the reference's best tokens as (log-prob, token id), best first
TopLogprobs = list[list[tuple[float, int]]]


class Divergence(BaseModel):
    """How a greedy answer compares with its reference."""

    kind: Literal["identical", "near_tie", "mismatch"]
    index: int | None = None
    expected: int | None = None  # the reference's token at `index` (None: the reference ended)
    got: int | None = None
    gap: float | None = None  # nats: the reference's log-prob of its token minus that of the token taken

    def describe(self) -> str:
        if self.kind == "identical":
            return "identical"
        gap = "" if self.gap is None else f" (gap {self.gap:.3f} nats)"
        return (f"token {self.index}: expected {_token(self.expected)}, got {_token(self.got)}"
                f"{' at a near-tie' if self.kind == 'near_tie' else ''}{gap}")


def top_logprobs(meta_info: dict[str, Any]) -> TopLogprobs | None:
    """SGLang's `output_top_logprobs` ([(logprob, token_id, text), ...] per position) as TopLogprobs."""
    rows = meta_info.get("output_top_logprobs")
    if not isinstance(rows, list):
        return None
    try:
        return [[(float(entry[0]), int(entry[1])) for entry in row or []] for row in rows]
    except (TypeError, ValueError, IndexError):
        return None


def compare(expected: list[int], got: list[int], top: TopLogprobs | None = None,
            tolerance: float = DEFAULT_TIE_TOLERANCE) -> Divergence:
    """The first place `got` parts from `expected`, judged against the reference's top log-probs."""
    index = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    if index is None:
        if len(expected) == len(got):
            return Divergence(kind="identical")
        index = min(len(expected), len(got))
    want = expected[index] if index < len(expected) else None
    took = got[index] if index < len(got) else None
    gap = _gap(top[index] if top is not None and index < len(top) else [], want, took)
    near = gap is not None and gap <= tolerance
    return Divergence(kind="near_tie" if near else "mismatch", index=index, expected=want, got=took, gap=gap)


def _gap(row: list[tuple[float, int]], want: int | None, took: int | None) -> float | None:
    """The reference's log-prob of `want` minus that of `took`, if both are among its recorded best."""
    logprob = {token: value for value, token in row}
    if want is None or took is None or want not in logprob or took not in logprob:
        return None
    return logprob[want] - logprob[took]


def _token(token: int | None) -> str:
    return "end" if token is None else str(token)
