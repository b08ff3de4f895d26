"""The newest ddtree core (since 0.2.1): the round's two tensor programs (`ddtree_verify_inputs`,
`ddtree_commit_plan`), which the worker captures in CUDA graphs, against a per-request
reference built on the host walk `follow_verified_tree`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

BLOCK = 8  # draft block S: trees have depth S - 1
VOCAB = 24
CONTEXT = 400


def batch_round(dd: ModuleType, budget: int, seed: int) -> dict[str, Any]:
    """A batch of 3 trees, their committed state and the target's picks (mostly on a path)."""
    g = torch.Generator().manual_seed(seed)
    bs = 3
    logits = torch.randn((bs, BLOCK - 1, VOCAB), generator=g) * 4.0
    tree = dd.build_ddtree_batch(logits, budget)
    prefix = torch.tensor([5, 17, 230])
    pool = torch.tensor([2, 0, 1])
    req_to_token = torch.randperm(3 * CONTEXT, generator=g).view(3, CONTEXT).to(torch.int32)
    picks = torch.randint(0, VOCAB, (bs, budget + 1), generator=g)
    for b, cut in enumerate((1, 3, BLOCK)):  # request b follows the tree for `cut` levels
        children: dict[int, list[tuple[int, int]]] = {}
        for (parent, token), child in sorted(tree.tree(b).child_map.items(), key=lambda kv: kv[1]):
            children.setdefault(parent, []).append((child, token))
        node = 0
        for depth in range(cut):
            if node not in children:
                break
            child, token = children[node][(b + seed) % len(children[node]) if (b, depth) == (1, 0) else 0]
            picks[b, node] = token
            node = child
        taken = {token for _, token in children.get(node, [])}
        picks[b, node] = next(t for t in range(VOCAB) if t not in taken)  # the walk stops here
    return {
        "logits": logits,
        "tree": tree,
        "prefix": prefix,
        "pool": pool,
        "req_to_token": req_to_token,
        "picks": picks,
        "bonus": torch.tensor([7, 3, 11]),
    }


@pytest.mark.parametrize("budget", [7, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_inputs_and_commit_plan_match_the_host_walk(dd: ModuleType, budget: int, seed: int) -> None:
    r = batch_round(dd, budget, seed)
    tree = r["tree"]
    ids, positions, slots = dd.ddtree_verify_inputs(tree, r["bonus"], r["prefix"], r["pool"], r["req_to_token"])
    plan = dd.ddtree_commit_plan(tree, r["picks"], ids, slots, r["prefix"])
    accepted_somewhere = False
    for b in range(3):
        single = tree.tree(b)
        n = single.num_nodes
        prefix = int(r["prefix"][b])
        # verify inputs: root = bonus, nodes then padding (token 0, depth 1), slots after the prefix
        want_ids = [int(r["bonus"][b])] + single.tokens.tolist() + [0] * (budget - n)
        want_depths = [0] + single.depths.tolist() + [1] * (budget - n)
        want_slots = r["req_to_token"][int(r["pool"][b]), prefix : prefix + budget + 1].tolist()
        assert ids[b].tolist() == want_ids
        assert positions[b].tolist() == [prefix + d for d in want_depths]
        assert slots[b].tolist() == want_slots
        # commit plan: the host walk decides the path and the bonus
        path, bonus = dd.follow_verified_tree(single, r["picks"][b, : n + 1])
        path = path.tolist()
        accepted = len(path) - 1
        accepted_somewhere |= accepted >= 2
        assert int(plan.commit_lens[b]) == accepted + 1
        assert int(plan.bonus[b]) == bonus
        assert plan.out_tokens[b].tolist() == ([want_ids[i] for i in path[1:]] + [bonus] + [0] * BLOCK)[:BLOCK]
        assert int(plan.new_seq_lens[b]) == prefix + accepted + 1
        assert plan.path[b].tolist() == (path + [path[-1]] * BLOCK)[:BLOCK]
        rest = [i for i in range(budget + 1) if i not in path]
        assert plan.committed_slots[b].tolist() == [want_slots[i] for i in path + rest]
    assert accepted_somewhere, "the picks should follow the tree often enough to accept 2+ nodes"


def test_commit_plan_keeps_dtypes_the_worker_relies_on(dd: ModuleType) -> None:
    r = batch_round(dd, 16, 5)
    ids, _, slots = dd.ddtree_verify_inputs(r["tree"], r["bonus"], r["prefix"], r["pool"], r["req_to_token"])
    plan = dd.ddtree_commit_plan(r["tree"], r["picks"], ids, slots, r["prefix"].to(torch.int32))
    assert slots.dtype == torch.int64
    assert plan.commit_lens.dtype == torch.int32
    assert plan.new_seq_lens.dtype == torch.int32
    assert sorted(plan.committed_slots[0].tolist()) == sorted(slots[0].tolist())  # a permutation


def test_padded_rows_with_stale_lengths_never_index_past_the_table(dd: ModuleType) -> None:
    """Inside a CUDA graph, rows past the batch carry stale lengths; the slot read is clamped."""
    r = batch_round(dd, 16, 3)
    far = torch.tensor([CONTEXT - 2, CONTEXT + 50, 0])
    _, _, slots = dd.ddtree_verify_inputs(r["tree"], r["bonus"], far, r["pool"], r["req_to_token"])
    assert slots.shape == (3, 17)


@pytest.mark.parametrize("seed", [0, 4])
def test_draft_top1_agreement_per_depth(dd: ModuleType, seed: int) -> None:
    r = batch_round(dd, 16, seed)
    top1 = r["logits"].argmax(dim=-1)
    accept_len, path = dd.follow_verified_tree_batch(r["tree"], r["picks"])
    got = dd.draft_top1_agreement(top1, r["picks"], path, accept_len).tolist()
    for b in range(3):
        want = []
        for depth in range(1, BLOCK):
            if depth > int(accept_len[b]):
                want.append(-1)
            else:
                target = int(r["picks"][b, int(path[b, depth - 1])])
                want.append(int(int(top1[b, depth - 1]) == target))
        assert got[b] == want
    assert any(v == 1 for row in got for v in row) and any(v == -1 for row in got for v in row)
