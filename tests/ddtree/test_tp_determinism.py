"""Overlay ddtree 0.3.0-rc.2 under tensor parallelism, on the CPU: two torch.distributed (gloo)
processes stand for two TP ranks. From the same draft logits (every tie-heavy family, budgets 16,
64 and 256, L = 15 as the published drafters) both build the same trees, bit for bit, and the debug
check the worker runs every round (``ddtree_check_across_ranks`` over a gloo group, as SGLang's TP
CPU group) passes; when one rank's logits differ by the smallest change that alters its tree, the
check raises on both ranks, naming the request and both hashes. Also the start-up rule and the hash.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddtree_deploy.catalog import load_overlay
from tests.ddtree.conftest import DDTREE_UTILS, LOGIT_FAMILIES, OVERLAYS

SPEC = "ddtree@0.3.0-rc.2"
TP_MODULE = "sglang/srt/speculative/ddtree_tp.py"
WORLD = 2
BUDGETS = [16, 64, 256]
BS, DEPTH, VOCAB, CONTEXT = 3, 15, 300, 600
RIDS = ["r0", "r1", "r2"]
CASES = [(family, budget) for family in LOGIT_FAMILIES for budget in BUDGETS]


@pytest.fixture(scope="module")
def tp(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(SPEC, TP_MODULE)


def case_logits(family: str, budget: int) -> torch.Tensor:
    return LOGIT_FAMILIES[family](torch.Generator().manual_seed(budget), (BS, DEPTH, VOCAB))


def round_hashes(dd: ModuleType, tp: ModuleType, logits: torch.Tensor, budget: int) -> dict[str, torch.Tensor]:
    """The round's tree, its verify inputs and the hash the worker compares."""
    tree = dd.build_ddtree_batch(logits, budget)
    req_to_token = torch.arange(BS * CONTEXT).view(BS, CONTEXT)
    ids, positions, _ = dd.ddtree_verify_inputs(
        tree, torch.tensor([7, 0, 11]), torch.tensor([5, 17, 230]), torch.tensor([2, 0, 1]), req_to_token
    )
    hashes = tp.ddtree_tree_hash(tokens=tree.tokens, parents=tree.parents, ids=ids, num_nodes=tree.num_nodes)
    # Scores compared as their float64 bits: the trees must agree to the last bit.
    return {"hash": hashes, "tokens": tree.tokens, "parents": tree.parents, "depths": tree.depths,
            "num_nodes": tree.num_nodes, "scores": tree.scores.view(torch.int64), "ids": ids, "positions": positions}


def nudge_runner_up(dd: ModuleType, logits: torch.Tensor) -> torch.Tensor:
    """Raise request 1's second token at depth 1 by as few ulps as make it the first (the smallest
    logit change that alters its tree)."""
    out = logits.clone()
    _, (first, second) = dd._ddtree_top_k(out[1, 0], 2)
    up = torch.tensor(float("inf"), dtype=out.dtype)
    out[1, 0, second] = out[1, 0, first]
    while int(dd._ddtree_top_k(out[1, 0], 1)[1][0]) != int(second):
        out[1, 0, second] = torch.nextafter(out[1, 0, second], up)
    return out


def _exec_module(name: str, source: bytes) -> ModuleType:
    module = ModuleType(name)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def _on_every_rank(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(WORLD)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _rank_main(rank: int, port: int, sources: dict[str, bytes], out: str) -> None:
    """One TP rank: every case with identical logits, then with rank 1's nudged."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD)), backend="gloo")  # as GroupCoordinator.cpu_group
        dd, tp = (_exec_module(name, source) for name, source in sources.items())
        results = []
        for perturbed in (False, True):
            for family, budget in CASES:
                logits = case_logits(family, budget)
                if perturbed and rank == 1:
                    logits = nudge_runner_up(dd, logits)
                r = round_hashes(dd, tp, logits, budget)
                try:
                    tp.ddtree_check_across_ranks(r["hash"], group=group, what="draft tree", rids=RIDS)
                    error = None
                except RuntimeError as e:
                    error = str(e)
                same = {name: _on_every_rank(value, group) for name, value in r.items() if name != "hash"}
                results.append({"family": family, "budget": budget, "perturbed": perturbed,
                                "hash": r["hash"].tolist(), "error": error, "same": same})
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Both ranks' results, from one spawn of two gloo processes."""
    overlay = load_overlay(SPEC, OVERLAYS)
    sources = {f"ddtree_{Path(p).stem}_rank": overlay.content_of(p, None) for p in (DDTREE_UTILS, TP_MODULE)}
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_rank_main, args=(free_port(), sources, str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_both_ranks_build_the_same_trees_from_the_same_logits(
        ranks: list[list[dict[str, Any]]], dd: ModuleType, tp: ModuleType) -> None:
    identical = [[r for r in results if not r["perturbed"]] for results in ranks]
    assert [len(results) for results in identical] == [len(CASES)] * WORLD
    for first, second, (family, budget) in zip(*identical, CASES, strict=True):
        assert first["error"] is None and second["error"] is None, (family, budget, first["error"])
        assert all(first["same"].values()), (family, budget, first["same"])
        # This process builds the same hashes: the tree does not depend on the process either.
        here = round_hashes(dd, tp, case_logits(family, budget), budget)["hash"].tolist()
        assert first["hash"] == second["hash"] == here, (family, budget)
        print(f"{family:8} budget {budget:3}: hashes {' '.join(f'{h:#018x}' for h in here)} on both ranks")


def test_a_rank_whose_logits_differ_fails_the_check_on_every_rank(ranks: list[list[dict[str, Any]]]) -> None:
    nudged = [[r for r in results if r["perturbed"]] for results in ranks]
    for first, second, (family, budget) in zip(*nudged, CASES, strict=True):
        assert not first["same"]["tokens"], (family, budget)
        h0, h1 = first["hash"][1], second["hash"][1]
        assert first["hash"][0] == second["hash"][0] and h0 != h1
        for result in (first, second):
            error = str(result["error"])
            assert "DDTREE draft tree differs across the TP group" in error, (family, budget, error)
            assert f"request r1 (batch row 1 of {BS})" in error
            assert f"{h0:#018x} on TP rank 0 and {h1:#018x} on TP rank 1" in error
    print(nudged[0][0]["error"])


def test_a_hybrid_target_stays_at_tp_1(tp: ModuleType) -> None:
    assert tp.ddtree_tp_refusal(tp_size=1, hybrid=True) is None
    assert tp.ddtree_tp_refusal(tp_size=8, hybrid=False) is None
    reason = tp.ddtree_tp_refusal(tp_size=2, hybrid=True)
    assert reason is not None and "supports --tp-size 1 only (got 2)" in reason and "Pass --tp-size 1" in reason


def test_the_hash_is_exact_modular_arithmetic(tp: ModuleType) -> None:
    """Against Python integers: no int64 overflow on large tokens or -1 parents, any width."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1 << 40, (4, 300), generator=g)
    parents = torch.randint(-1, 300, (4, 301), generator=g)
    got = tp.ddtree_hash_rows(tokens, parents).tolist()
    prime = (1 << 31) - 1
    for row in range(4):
        values = tokens[row].tolist() + parents[row].tolist()
        halves = [sum(v % prime * pow(base, i + 1, prime) for i, v in enumerate(values)) % prime
                  for base in tp._DDTREE_HASH_BASES]
        assert got[row] == halves[0] * (1 << 31) + halves[1]
    changed = parents.clone()
    changed[2, 150] += 1
    rehashed = tp.ddtree_hash_rows(tokens, changed).tolist()
    assert [a == b for a, b in zip(rehashed, got, strict=True)] == [True, True, False, True]
    with pytest.raises(ValueError, match="integer tensors of shape"):
        tp.ddtree_hash_rows(torch.zeros(4, 3))
