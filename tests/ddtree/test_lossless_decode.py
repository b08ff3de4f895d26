"""Lossless CPU fp32 decoding with DDTree: the tree round must emit the target's own greedy tokens.

Uses overlays/ddtree/tools/ddtree_cpu_decode.py: one tree verify forward per round with a 4-D
mask and positions start + depth, accepted KV entries kept, on a random pair (a target whose
attention matters) and on the hand-set copy pair (long acceptances, near-tied drafts).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from ddtree_deploy.catalog import default_version, load_overlay
from ddtree_deploy.overlay import versions_in
from tests.ddtree.conftest import DDTREE_UTILS, OVERLAYS

BUDGETS = [1, 4, 16, 64]
MAX_NEW_TOKENS = 24


# Pre-releases whose core differs from the newest release's, each tested by name in the file given
# (0.3.0-rc.3 only adds the CUDA dispatch to its Triton tree builder, its torch path unchanged;
# 0.3.0-rc.4 adds the commit's KV moves and drops the req_to_token rewrite from the commit plan;
# 0.3.0-rc.16 takes the top-K with Triton kernels on CUDA, its CPU path the same int64 key:
# test_tree_build_triton.py builds its trees through them, test_top_k.py holds its top-K to 0.1.0's;
# 0.3.0-rc.18 splits rc.17's core in three modules: test_core_split.py holds it to rc.17's).
CORES_TESTED_BY_NAME = {"0.3.0-rc.3": "test_tree_build_triton.py", "0.3.0-rc.4": "test_commit_moves.py",
                        "0.3.0-rc.16": "test_tree_build_triton.py", "0.3.0-rc.18": "test_core_split.py"}


def test_the_tool_and_the_tests_run_the_newest_versions_core(decode_tool: ModuleType, dd: ModuleType) -> None:
    versions = versions_in(OVERLAYS / "ddtree")
    newest = default_version(versions)  # the newest release; a later pre-release lands the same core, or these tests lag it
    assert load_overlay("ddtree", OVERLAYS).version == newest
    core = load_overlay(f"ddtree@{newest}", OVERLAYS).content_of(DDTREE_UTILS, None)
    tested = {core}
    for version, test_file in CORES_TESTED_BY_NAME.items():
        assert f'"ddtree@{version}"' in (Path(__file__).parent / test_file).read_text(), test_file
        tested.add(load_overlay(f"ddtree@{version}", OVERLAYS).content_of(DDTREE_UTILS, None))
    for later in versions[versions.index(newest) + 1:]:
        assert load_overlay(f"ddtree@{later}", OVERLAYS).content_of(DDTREE_UTILS, None) in tested, later
    assert dd.__file__ == f"ddtree@{newest}:{DDTREE_UTILS}"
    assert decode_tool.load_ddtree_utils() is dd is decode_tool.load_ddtree_utils(f"ddtree@{newest}")


@pytest.mark.parametrize("pair", ["random", "copy"])
def test_tree_decoding_is_lossless(decode_tool: ModuleType, pair: str) -> None:
    target, drafter_for = decode_tool.PAIRS[pair]()
    report = []
    for name, prompt in decode_tool.prompts(pair):
        reference = decode_tool.greedy_generate(target, prompt, MAX_NEW_TOKENS)
        drafter = drafter_for(prompt, reference)
        chain = decode_tool.ddtree_generate(
            target, drafter, prompt, MAX_NEW_TOKENS, decode_tool.BLOCK_SIZE - 1, chain=True
        )
        assert chain.tokens == reference, (name, "chain")
        row = [f"chain {chain.mean_accept_length:.2f}"]
        for budget in BUDGETS:
            got = decode_tool.ddtree_generate(target, drafter, prompt, MAX_NEW_TOKENS, budget)
            assert got.tokens == reference, (name, budget)
            assert all(1 <= a <= decode_tool.BLOCK_SIZE for a in got.accept_lengths)
            row.append(f"B={budget} {got.mean_accept_length:.2f}")
        report.append(f"{pair}/{name}: " + ", ".join(row))
    print("\n".join(report))


def test_copy_pair_trees_beat_the_chain_where_drafts_tie(decode_tool: ModuleType) -> None:
    target, drafter_for = decode_tool.make_copy_pair()
    prompts = dict(decode_tool.prompts("copy"))
    repeat, alternate = prompts["repeat-0"], prompts["alternate"]
    drafter = drafter_for(repeat, [])
    # Drafts right at every depth: the chain and a large tree both accept whole blocks.
    block = decode_tool.BLOCK_SIZE
    chain = decode_tool.ddtree_generate(target, drafter, repeat, MAX_NEW_TOKENS, block - 1, chain=True)
    assert chain.accept_lengths[0] == block
    assert decode_tool.ddtree_generate(target, drafter, repeat, MAX_NEW_TOKENS, 64).accept_lengths[0] == block
    # Alternating prompt: top two draft tokens nearly tie, the chain accepts at most one node.
    chain = decode_tool.ddtree_generate(target, drafter, alternate, MAX_NEW_TOKENS, block - 1, chain=True)
    tree = decode_tool.ddtree_generate(target, drafter, alternate, MAX_NEW_TOKENS, 64)
    assert max(chain.accept_lengths) <= 2
    assert tree.mean_accept_length > chain.mean_accept_length + 2
