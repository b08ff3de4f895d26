"""DDTREE under tensor parallelism: the start-up rule, and a hash of each round's trees compared across the TP group.

Every rank of a TP group builds the round's trees itself, from the same all-gathered draft logits,
and must build the same ones: the verify's all-reduces add up the ranks' partial results for the
tokens each rank put at each position, so trees that differ would mix two verifies without an error.
With ``--speculative-ddtree-debug`` the worker hashes every round's trees (node tokens, parents and
the verify input ids) and its commit (the tokens and lengths each request takes), and compares the
hashes across the group (``ddtree_check_across_ranks``).

Torch only (no sglang imports), so it is tested on the CPU with a gloo group.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "ddtree_check_across_ranks",
    "ddtree_hash_rows",
    "ddtree_tp_mismatch",
    "ddtree_tp_refusal",
    "ddtree_tree_hash",
]

# Two polynomial hashes modulo the Mersenne prime 2^31 - 1, packed into one int64 (62 bits). Every
# product of two residues stays below 2^62, so the arithmetic is exact in int64 on every device,
# with no reliance on overflow.
_DDTREE_HASH_PRIME = (1 << 31) - 1
_DDTREE_HASH_BASES = (1_000_003, 1_234_567_891)


def ddtree_tp_refusal(*, tp_size: int, hybrid: bool) -> Optional[str]:
    """Why DDTREE cannot run at this tensor-parallel size, or None.

    Attention-only targets run at any ``--tp-size``: the draft logits are all-gathered over the
    vocabulary shards, so every rank builds the same trees. A hybrid (GatedDeltaNet) target stays at
    ``--tp-size 1``: its per-node recurrent-state memory rule counts one rank holding every head, and
    its state commit has not been run with sharded heads.
    """
    if tp_size > 1 and hybrid:
        return (
            f"DDTREE on a hybrid GatedDeltaNet target supports --tp-size 1 only (got {tp_size}): its "
            "per-node recurrent-state memory rule counts one rank holding every head, and its state "
            "commit has not been validated with sharded heads. Pass --tp-size 1, or use "
            "--speculative-algorithm DFLASH."
        )
    return None


def _ddtree_powers(base: int, length: int, device: torch.device) -> torch.Tensor:
    """base^1 .. base^length modulo the prime, by doubling (device ops only)."""
    powers = torch.tensor([base], dtype=torch.int64, device=device)
    while powers.numel() < length:
        powers = torch.cat([powers, powers * powers[-1:] % _DDTREE_HASH_PRIME])
    return powers[:length]


def ddtree_hash_rows(*columns: torch.Tensor) -> torch.Tensor:
    """A 62-bit hash of every row of integer tensors, the same on every device.

    Args:
        columns: Integer tensors with the batch as their first dimension. Shapes: [bs] or [bs, k].

    Returns:
        int64 [bs]: equal rows (same shapes, same values) hash equal.
    """
    if not columns:
        raise ValueError("ddtree_hash_rows needs at least one tensor.")
    rows = int(columns[0].shape[0])
    for column in columns:
        if column.is_floating_point() or column.dim() not in (1, 2) or int(column.shape[0]) != rows:
            raise ValueError(
                f"ddtree_hash_rows takes integer tensors of shape [{rows}] or [{rows}, k], "
                f"got {column.dtype} of shape {tuple(column.shape)}."
            )
    values = torch.cat([c.view(rows, -1).to(torch.int64) for c in columns], dim=1)
    residues = torch.remainder(values, _DDTREE_HASH_PRIME)  # -1 (no parent) becomes prime - 1
    halves = []
    for base in _DDTREE_HASH_BASES:
        powers = _ddtree_powers(base, values.shape[1], values.device)
        # Each term is below 2^31 after the modulo, so the row sum stays far below 2^63.
        halves.append((residues * powers[None, :] % _DDTREE_HASH_PRIME).sum(dim=1) % _DDTREE_HASH_PRIME)
    return halves[0] * (1 << 31) + halves[1]


def ddtree_tree_hash(
    *, tokens: torch.Tensor, parents: torch.Tensor, ids: torch.Tensor, num_nodes: torch.Tensor
) -> torch.Tensor:
    """The hash of each request's tree of a round and its verify input.

    Args:
        tokens: Node tokens (``DDTreeBatch.tokens``). Shape: [bs, budget].
        parents: Parent of every node, root first (``DDTreeBatch.parents``). Shape: [bs, budget + 1].
        ids: The verify input ids, the root first (``ddtree_verify_inputs``). Shape: [bs, budget + 1].
        num_nodes: Nodes per tree. Shape: [bs].

    Returns:
        int64 [bs].
    """
    return ddtree_hash_rows(num_nodes, tokens, parents, ids)


def ddtree_tp_mismatch(hashes: torch.Tensor, *, what: str, rids: Sequence[str]) -> Optional[str]:
    """The first request whose hash differs between ranks, as an error message, or None.

    Args:
        hashes: Every rank's hashes, row r from TP rank r. Shape: [tp_size, bs], int64.
        what: What was hashed ("draft tree", "commit"), for the message.
        rids: Request ids of the batch rows.
    """
    differs = (hashes != hashes[:1]).any(dim=0)
    if not bool(differs.any()):
        return None
    row = int(differs.nonzero()[0, 0])
    rank = int((hashes[:, row] != hashes[0, row]).nonzero()[0, 0])
    rid = rids[row] if row < len(rids) else "?"
    return (
        f"DDTREE {what} differs across the TP group (--speculative-ddtree-debug): request {rid} "
        f"(batch row {row} of {hashes.shape[1]}) hashes {int(hashes[0, row]):#018x} on TP rank 0 "
        f"and {int(hashes[rank, row]):#018x} on TP rank {rank}; the ranks would verify different "
        "trees and mix them in the all-reduces."
    )


def ddtree_check_across_ranks(
    hashes: torch.Tensor, *, group: Optional[dist.ProcessGroup], what: str, rids: Sequence[str]
) -> None:
    """Compare this round's hashes with every rank of the TP group; every rank raises on a mismatch.

    Args:
        hashes: This rank's hashes. Shape: [bs], int64, any device (copied to the host).
        group: The TP group's CPU (gloo) process group; None is the default group.
        what, rids: For the message (``ddtree_tp_mismatch``).

    Raises:
        RuntimeError: naming the request and both hashes.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    local = hashes.detach().to(device="cpu", dtype=torch.int64).contiguous()
    gathered: List[torch.Tensor] = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    reason = ddtree_tp_mismatch(torch.stack(gathered), what=what, rids=rids)
    if reason is not None:
        raise RuntimeError(reason)
