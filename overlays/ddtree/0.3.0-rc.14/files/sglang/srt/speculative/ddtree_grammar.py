"""A DDTREE round's grammar constraint: each constrained request's accepted path, checked node by
node against its grammar on the host, after the verify.

SGLang's tree verify (EAGLE's) fills a grammar bitmask for every node its grammar admits before
the picks, so a constrained round's host work grows with the tree. Only the nodes on the accepted path need their grammar's mask,
and a pick its grammar allows is already the masked pick where the sampler does not truncate: at
T = 0 (or top-k 1) the argmax among the allowed tokens, and under temperature alone a draw that
landed in the allowed set, which is a draw from the renormalised allowed distribution. Where the
grammar refuses a pick, a fresh draw from the masked logits is exact. So the walk fills the mask at
each node of its path (at most the block, as the DFlash chain does) and asks for new picks only for
refused nodes. A truncating sampler (top-k above 1, top-p, min-p) cuts the unmasked distribution
where the masked rule cuts the masked one, so an allowed draw is not the masked rule's: such a
request's walk draws every pick on its path again from the masked logits (one batched draw a depth).

Bitmasks are SGLang's packed layout (32 tokens to an int32 word, as ``traverse_tree`` reads them):
xgrammar's and llguidance's. outlines keeps a boolean mask and cannot roll back, so DDTREE refuses
it at start-up (``ddtree_grammar_backend_refusal``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Protocol, Sequence

import torch


PACKED_MASK_BACKENDS = ("xgrammar", "llguidance")


def ddtree_grammar_backend_refusal(grammar_backend: Optional[str]) -> Optional[str]:
    """Why DDTREE cannot run with this ``--grammar-backend`` (None: it can; "none" has no grammars)."""
    if grammar_backend in (None, "none", *PACKED_MASK_BACKENDS):
        return None
    return (
        f"DDTREE does not support --grammar-backend {grammar_backend}: its tree rounds read grammar "
        f"bitmasks in the packed layout and roll grammars back ({', '.join(PACKED_MASK_BACKENDS)}); "
        "pass --grammar-backend xgrammar."
    )


class Grammar(Protocol):
    """What the walk uses of SGLang's ``BaseGrammarObject``."""

    def accept_token(self, token: int) -> None: ...
    def rollback(self, k: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None: ...


# Given flat node rows whose picks their grammars refused (the masks of those rows filled), new
# picks for those rows, drawn from the verify logits under the masks.
Repick = Callable[[List[int]], Sequence[int]]


@dataclasses.dataclass
class _Walk:
    request: int
    grammar: Grammar
    redraw: bool  # every pick on the path drawn again from the masked logits (a truncating sampler)
    node: int = 0
    accepted: int = 0  # tokens pushed into the grammar, rolled back when the walk ends


def _allowed(vocab_mask: torch.Tensor, row: int, token: int) -> bool:
    return (int(vocab_mask[row, token >> 5]) >> (token & 31)) & 1 == 1


def _child(next_token: torch.Tensor, next_sibling: torch.Tensor, ids: torch.Tensor, walk: _Walk,
           token: int) -> int:
    """The node's child holding ``token`` (first-child / next-sibling links), else -1."""
    child = int(next_token[walk.request, walk.node])
    while child != -1 and int(ids[walk.request, child]) != token:
        child = int(next_sibling[walk.request, child])
    return child


def ddtree_grammar_picks(
    grammars: Sequence[Optional[Grammar]],
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    ids: torch.Tensor,
    picks: torch.Tensor,
    vocab_mask: torch.Tensor,
    repick: Repick,
    redraw: Optional[Sequence[bool]] = None,
) -> List[int]:
    """Make every constrained request's picks along its accepted path obey its grammar.

    Args:
        grammars: Per request, its grammar (already advanced over its committed tokens) or None.
        next_token, next_sibling, ids: The trees' links and verify ids on the host, ``[bs, n]``.
        picks: The target's pick at every node on the host, ``[bs, n]``; corrected in place.
        vocab_mask: Host bitmask ``[bs * n, words]``, all allowed; the walk fills its path's rows.
        repick: New picks for refused rows (see ``Repick``).
        redraw: Per request, whether its sampler truncates (see above); default none does.

    Returns:
        The flat rows whose picks changed (empty: the device's picks stand).
    """
    n = picks.shape[1]
    walks = [_Walk(i, g, bool(redraw and redraw[i])) for i, g in enumerate(grammars) if g is not None]
    filled: set = set()
    changed: List[int] = []
    while walks:
        walks = [w for w in walks if not _advance(w, n, next_token, next_sibling, ids, picks, vocab_mask, filled,
                                                  set(changed))]
        if walks:
            rows = [w.request * n + w.node for w in walks]
            for row, token in zip(rows, repick(rows), strict=True):
                picks.view(-1)[row] = int(token)
            changed += rows
    return changed


def _advance(walk: _Walk, n: int, next_token: torch.Tensor, next_sibling: torch.Tensor, ids: torch.Tensor,
             picks: torch.Tensor, vocab_mask: torch.Tensor, filled: set, repicked: set) -> bool:
    """Walk down while the picks stand. False: stopped at a pick to draw again (refused, or any pick
    of a ``redraw`` walk; its mask filled); True: the walk ended (no child holds the pick, or the
    grammar ended), the grammar rolled back. A repicked row's pick stands (it is the masked logits'
    own; where even it is refused, the mask allows nothing, and the walk ends there without
    taking it, leaving the refusal to the scheduler's own ``accept_token``, as SGLang's does)."""
    grammar = walk.grammar
    while not grammar.is_terminated():  # past its end a grammar constrains nothing (as traverse_tree)
        row = walk.request * n + walk.node
        if row not in filled:
            grammar.fill_vocab_mask(vocab_mask, row)
            filled.add(row)
        token = int(picks[walk.request, walk.node])
        allowed = _allowed(vocab_mask, row, token)
        if row not in repicked and (walk.redraw or not allowed):
            return False
        if not allowed:
            break
        child = _child(next_token, next_sibling, ids, walk, token)
        if child == -1:
            break
        grammar.accept_token(token)
        walk.accepted += 1
        walk.node = child
    if walk.accepted:
        grammar.rollback(walk.accepted)
    return True
