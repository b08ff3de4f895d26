"""tools/gpu/make_induction_hybrid.py's target, run on the CPU with transformers' own Qwen3-Next (its
torch GatedDeltaNet): the next token is the one after the current token's latest earlier occurrence,
with a large margin, so it depends on the recurrent state, not on the current token."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.gpu_tools import load_gpu_tool

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    tool: ModuleType = load_gpu_tool("make_induction_hybrid")
    config = transformers.Qwen3NextConfig(  # make_hybrid.py's shapes (the GPU run's hyb_copy)
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
    torch.manual_seed(0)
    return tool.set_induction(transformers.Qwen3NextForCausalLM(config)).eval()


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, out, margins = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(steps):
            top = model(ids).logits[0, -1].topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1][None]], dim=1)
    return out, margins


def test_it_continues_the_cycle_it_has_seen_with_a_large_margin(model: torch.nn.Module) -> None:
    out, margins = greedy(model, [10, 11, 12, 13, 14, 15, 10], 8)
    assert out == [11, 12, 13, 14, 15, 10, 11, 12]
    assert min(margins) > 10


def test_the_same_last_token_continues_by_its_history(model: torch.nn.Module) -> None:
    assert greedy(model, [6, 7, 5, 6], 3)[0] == [7, 5, 6]
    assert greedy(model, [6, 8, 5, 6], 3)[0] == [8, 5, 6]
    assert greedy(model, [20, 21, 22, 20, 23, 24, 20], 1)[0] == [23]  # the latest occurrence wins


def test_an_unseen_token_repeats(model: torch.nn.Module) -> None:
    out, margins = greedy(model, [30, 31, 32, 33], 3)
    assert out == [33, 33, 33] and margins[0] > 4
