"""Overlay ddtree 0.3.0-rc.1 on GDN hybrids: the recurrent state a round commits.

- ``ddtree_gdn_chain_state`` (the debug check's fp32 oracle) against transformers' own
  Qwen3-Next reference (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``).
- A transcription of SGLang's two tree kernels (conv window over the link-derived
  ancestors, recurrence from the parent's snapshot, one snapshot per node): committing the
  last accepted node's snapshot equals a chain pass over the accepted tokens.
- ``DDTreeStateCheck`` passes on that commit and catches the planted fault of the GPU run:
  the deduplicated conv-window layout (memory_pool.py's overlapping ``as_strided`` view)
  left on under a tree verify.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from tests.ddtree.test_hybrid_links import kernel_parents, trees
from tests.ddtree.test_hybrid_rules import hybrid_module

H, HV, DK, DV, KW = 2, 4, 8, 8, 4  # key heads, value heads, head dims, conv kernel
DIM = 2 * H * DK + HV * DV


@pytest.fixture(scope="module")
def hybrid() -> ModuleType:
    return hybrid_module()


def gdn_layer(seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        layer_id=seed, conv_weights=torch.randn((DIM, KW), generator=g) * 0.5,
        bias=torch.randn((DIM,), generator=g) * 0.1, A_log=torch.randn((HV,), generator=g) * 0.3,
        dt_bias=torch.randn((HV,), generator=g) * 0.3, num_k_heads=H, head_k_dim=DK, head_v_dim=DV,
    )


def oracle(hybrid: ModuleType, layer: SimpleNamespace, conv: torch.Tensor, ssm: torch.Tensor,
           x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hybrid.ddtree_gdn_chain_state(
        conv_state=conv, ssm_state=ssm, x=x, a=a, b=b, conv_weight=layer.conv_weights, conv_bias=layer.bias,
        A_log=layer.A_log, dt_bias=layer.dt_bias, num_k_heads=H, head_k_dim=DK, head_v_dim=DV)


def test_chain_oracle_matches_transformers_qwen3_next(hybrid: ModuleType) -> None:
    g = torch.Generator().manual_seed(0)
    layer = gdn_layer(1)
    steps = 6
    conv = torch.randn((DIM, KW - 1), generator=g)
    ssm = torch.randn((HV, DV, DK), generator=g) * 0.2  # SGLang's layout [HV, V, K]
    x, a, b = (torch.randn(shape, generator=g) for shape in ((steps, DIM), (steps, HV), (steps, HV)))
    want_conv, want_ssm = oracle(hybrid, layer, conv, ssm, x, a, b)

    state = conv[None].clone()
    out = hf.causal_conv1d_update(x.t()[None].contiguous(), state, layer.conv_weights, layer.bias, "silu")[0].t()
    q, k, v = torch.split(out, [H * DK, H * DK, HV * DV], dim=-1)
    g_decay = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    _, final = hf.torch_recurrent_gated_delta_rule(
        q.reshape(1, steps, H, DK), k.reshape(1, steps, H, DK), v.reshape(1, steps, HV, DV),
        g=g_decay[None], beta=b.sigmoid()[None], initial_state=ssm.transpose(1, 2)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(want_conv, state[0])
    torch.testing.assert_close(want_ssm, final[0].transpose(1, 2), rtol=1e-5, atol=1e-5)


def tree_verify(hybrid: ModuleType, layer: SimpleNamespace, parents: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """SGLang's tree kernels for one request, transcribed: node t's conv window holds it
    and its K-2 nearest ancestors (past the root, the committed window's newest columns),
    written slot by slot into ``windows[t]`` in token order; its SSM state starts from its
    parent's snapshot. Returns the snapshots [N, HV, V, K]."""
    width = parents.shape[0]
    snapshots = torch.empty((width, HV, DV, DK))  # fp32, as intermediate_ssm
    for t in range(width):
        chain, node = [], t
        for _ in range(KW - 1):  # self, parent, ... (K - 1 entries)
            chain.append(x[node] if node >= 0 else conv[:, KW - 1 + node])
            node = int(parents[node]) if node > 0 else node - 1
        for j, value in enumerate(chain):
            windows[t][:, KW - 2 - j] = value
        start = ssm if t == 0 else snapshots[int(parents[t])]
        # One recurrence step from the parent's state, over the window the conv reads.
        window = windows_before(conv, parents, x, t)
        _, snapshots[t] = oracle(hybrid, layer, window, start, x[t][None], a[t][None], b[t][None])
    return snapshots


def windows_before(conv: torch.Tensor, parents: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
    """The K-1 inputs before node t on its root path (the window its conv reads)."""
    cols, node = [], (int(parents[t]) if t > 0 else -1)
    for _ in range(KW - 1):
        cols.append(x[node] if node >= 0 else conv[:, KW - 1 + node])
        node = int(parents[node]) if node > 0 else node - 1
    return torch.stack(cols[::-1], dim=1)


def dedup_windows(width: int) -> torch.Tensor:
    """memory_pool.py's deduplicated conv-window layout: one [dim, width + K - 2] buffer
    with an overlapping view where step t's window is columns t .. t + K - 2."""
    phys = torch.zeros((DIM, width + KW - 2), dtype=torch.bfloat16)
    return phys.as_strided((width, DIM, KW - 1), (phys.stride(1), phys.stride(0), phys.stride(1)))


def run_round(hybrid: ModuleType, dd: ModuleType, seed: int, dedup: bool) -> list[dict[str, object]]:
    """One DDTREE round on a fake 2-layer GDN target: tree verify, walk, commit, check."""
    g = torch.Generator().manual_seed(seed)
    tree = trees(dd, 16, seed)
    bs, width = tree.parents.shape
    _, next_token, next_sibling = dd.tree_links(tree)
    parents = kernel_parents(next_token, next_sibling)
    layers = [gdn_layer(10 + i) for i in range(2)]
    slots = torch.tensor([3, 1, 0, 2])
    pool = {layer.layer_id: (torch.randn((5, DIM, KW - 1), generator=g).bfloat16(),
                         torch.randn((5, HV, DV, DK), generator=g) * 0.2) for layer in layers}
    check = hybrid.DDTreeStateCheck(lambda i: pool[i], [layer.layer_id for layer in layers])
    backend = SimpleNamespace(forward_extend=lambda layer, fb, mixed_qkv, a, b, **kw: None)
    check.install(backend)
    check.before_verify(slots)
    # The walk accepts a random root path of each tree (on its real nodes).
    path = torch.zeros((bs, 8), dtype=torch.int64)
    lens = torch.ones(bs, dtype=torch.int64)
    for row in range(bs):
        node = 0
        for depth in range(1, 8):
            kids = [c for c in range(1, int(tree.num_nodes[row]) + 1) if int(tree.parents[row, c]) == node]
            if not kids or torch.rand((), generator=g) < 0.15:
                break
            node = kids[int(torch.randint(len(kids), (), generator=g))]
            path[row, depth], lens[row] = node, depth + 1
        path[row, int(lens[row]):] = node
    verify = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    for layer in layers:
        conv_pool, ssm_pool = pool[layer.layer_id]
        x = torch.randn((bs * width, DIM), generator=g).bfloat16()
        a, b = torch.randn((bs * width, HV), generator=g), torch.randn((bs * width, HV), generator=g)
        backend.forward_extend(layer, verify, x, a, b)
        for row in range(bs):
            rows = slice(row * width, (row + 1) * width)
            windows = dedup_windows(width) if dedup else torch.zeros((width, DIM, KW - 1), dtype=torch.bfloat16)
            slot = int(slots[row])
            snaps = tree_verify(hybrid, layer, parents[row], conv_pool[slot].clone(), ssm_pool[slot].clone(),
                                x[rows], a[rows], b[rows], windows)
            last = int(path[row, int(lens[row]) - 1])
            conv_pool[slot], ssm_pool[slot] = windows[last], snaps[last]  # the commit's scatter
    return check.after_commit(path, lens, width)


@pytest.mark.parametrize("seed", [0, 1])
def test_committing_the_last_accepted_node_equals_a_chain_pass(hybrid: ModuleType, dd: ModuleType, seed: int) -> None:
    results = run_round(hybrid, dd, seed, dedup=False)
    assert all(r["checked"] and r["ok"] and r["conv_exact"] for r in results), results
    assert max(float(r["ssm_max_abs"]) for r in results) < 1e-6  # the same fp32 arithmetic


def test_state_check_catches_the_deduplicated_conv_layout(hybrid: ModuleType, dd: ModuleType) -> None:
    results = [r for seed in range(2) for r in run_round(hybrid, dd, seed, dedup=True)]
    assert any(not r["conv_exact"] and not r["ok"] for r in results), results


def test_state_check_without_recorded_inputs_says_unchecked(hybrid: ModuleType) -> None:
    check = hybrid.DDTreeStateCheck(lambda i: (torch.zeros((2, DIM, KW - 1)), torch.zeros((2, HV, DV, DK))), [0])
    check.before_verify(torch.tensor([1]))  # a CUDA-graph replay runs no Python: nothing recorded
    assert check.after_commit(torch.zeros((1, 8), dtype=torch.int64), torch.ones(1), 17) == [{"checked": False}]
