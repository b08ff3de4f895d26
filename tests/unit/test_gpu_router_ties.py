"""tools/gpu/router_ties.py on a tiny random Qwen3-Next (GDN + attention, 4 experts top-2) on the CPU:
it finds the split, its per-layer router gaps match the model's own router logits in both shapes, a
planted exact tie reads 0, and prompts that do not split are left out."""

from __future__ import annotations

import copy
from types import ModuleType

import pytest
import torch

from tests.gpu_tools import load_gpu_tool

transformers = pytest.importorskip("transformers")

PROMPT = [3, 14, 15, 92, 65]
REF_OUT = [7, 33, 101, 2, 58, 77, 19, 120, 5, 64, 11, 90]
FIRST = 6  # REF and CASE differ first at output 6
POS = len(PROMPT) + FIRST - 1
TIE_LAYER = 1


def tool() -> ModuleType:
    return load_gpu_tool("router_ties")


def build() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(bf16, fp32) with the same bf16 weights, as the tool loads a bf16 checkpoint."""
    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)  # router gaps of order 1, so a wrong position shows
    bf16 = model.to(torch.bfloat16)
    return bf16, copy.deepcopy(bf16).float()


def results(case_out: list[int]) -> tuple[dict, dict]:
    """Fake client files: single = [splitting prompt, identical prompt], batch4 = [identical]."""
    other = [9, 8, 7]
    same = [4, 4, 5, 6, 1, 2]

    def rec(p: list[int], out: list[int]) -> dict:
        return {"prompt": p, "output_ids": out, "meta": {"prompt_tokens": len(p)}}

    ref = {"single": [rec(PROMPT, REF_OUT), rec(other, same)], "batch4": [rec(PROMPT, REF_OUT)]}
    case = {"single": [rec(PROMPT, case_out), rec(other, same)], "batch4": [rec(PROMPT, REF_OUT)]}
    return ref, case


CASE_OUT = REF_OUT[:FIRST] + [REF_OUT[FIRST] + 1] + REF_OUT[FIRST + 1:]


def router_gaps(out: object, k: int, row: int) -> list[float]:
    """The k/k+1 gap of every MoE layer's router at `row`, from the model's own output_router_logits
    (raw logits in transformers 5.25, softmax probabilities in 5.12: their log has the same gaps)."""
    res = []
    for r in out.router_logits:  # type: ignore[attr-defined]
        x = r.float()
        if bool((x >= 0).all()) and torch.allclose(x.sum(-1), torch.ones(x.shape[0]), atol=1e-3):
            x = x.log()
        s = x[row].sort(descending=True).values
        res.append(float(s[k - 1] - s[k]))
    return res


def incremental(model: torch.nn.Module, prompt: list[int], decoded: list[int]) -> object:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    for t in decoded:
        out = model(input_ids=torch.tensor([[t]]), cache=out.cache, use_cache=True, output_router_logits=True)
    return out


def test_split_found_and_gaps_match_the_routers_own_logits() -> None:
    t = tool()
    bf16, fp32 = build()
    ref, case = results(CASE_OUT)
    res = t.analyse(bf16, fp32, ref, case)
    assert (res["identical"], res["total"]) == (2, 3)
    assert res["moe_layers"] == [0, 1, 2, 3]
    [row] = res["splits"]  # the prompts that do not split are not analysed
    assert (row["mode"], row["index"], row["first"], row["position"]) == ("single", 0, FIRST, POS)
    assert (row["ref_token"], row["case_token"], row["prefill"]) == (REF_OUT[FIRST], CASE_OUT[FIRST], False)
    prefix = PROMPT + REF_OUT[:FIRST]
    with torch.no_grad():
        want32 = router_gaps(fp32(input_ids=torch.tensor([prefix]), output_router_logits=True), 2, POS)
        want16 = router_gaps(bf16(input_ids=torch.tensor([prefix]), output_router_logits=True), 2, POS)
        want_inc = router_gaps(incremental(bf16, PROMPT, REF_OUT[:FIRST]), 2, 0)
        logits = fp32(input_ids=torch.tensor([prefix])).logits[0, POS]
    assert min(want32) > 0.01  # no accidental tie: the values below are not all 0
    for r, w32, w16, winc in zip(row["router"], want32, want16, want_inc, strict=True):
        assert r["gap_fp32"] == pytest.approx(w32, abs=1e-4)
        assert r["gap_bf16_prefix"] == pytest.approx(w16, abs=1e-4)
        assert r["gap_bf16_incremental"] == pytest.approx(winc, abs=1e-4)
    assert row["min_gap_fp32"] == pytest.approx(min(want32), abs=1e-4)
    assert row["min_gap_layer"] == want32.index(min(want32))
    top = logits.topk(2)
    assert row["target_gap_fp32"] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-3)
    assert row["target_top2"][0][1] == int(top.indices[0])
    # Context: every position of prompt + REF's output but the split one, min over layers.
    seq = PROMPT + REF_OUT
    with torch.no_grad():
        full = fp32(input_ids=torch.tensor([seq]), output_router_logits=True)
    mins = [min(router_gaps(full, 2, j)) for j in range(len(seq)) if j != POS]
    ns = res["nonsplit"]
    assert ns["positions"] == len(seq) - 1
    assert ns["position_min_gap"]["min"] == pytest.approx(min(mins), abs=1e-4)
    assert ns["position_min_gap"]["median"] == pytest.approx(float(torch.tensor(mins).median()), abs=0.2)
    share = sum(m <= min(want32) + 1e-6 for m in mins) / len(mins)
    assert row["share_nonsplit_at_or_below"] == pytest.approx(share, abs=1e-3)
    assert "ROUTER_TIES[x] 2/3 identical; 1 splits" in t.summary(res, "x")
    assert f"first_diff={FIRST} pos={POS}" in t.line(row)


def test_a_planted_exact_tie_reads_zero() -> None:
    """Layer 1's experts 1 and 2 get the same router row, expert 0 a row 3 above and expert 3 one 3
    below at the split token: experts 1 and 2 are 2nd and 3rd there, tied exactly in every dtype."""
    t = tool()
    bf16, _ = build()
    gate = bf16.model.layers[TIE_LAYER].mlp.gate
    seen: list[torch.Tensor] = []
    h = gate.register_forward_hook(lambda m, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        bf16(input_ids=torch.tensor([PROMPT + REF_OUT[:FIRST]]))
    h.remove()
    x = seen[0][POS].float()
    u = 3 * x / x.dot(x)
    r = torch.randn(x.shape[0]) * 0.01
    with torch.no_grad():
        gate.weight.copy_(torch.stack([r + u, r, r, r - u]).to(torch.bfloat16))
    fp32 = copy.deepcopy(bf16).float()
    ref, case = results(CASE_OUT)
    [row] = t.analyse(bf16, fp32, ref, case)["splits"]
    tie = row["router"][TIE_LAYER]
    assert (tie["gap_fp32"], tie["gap_bf16_prefix"], tie["gap_bf16_incremental"]) == (0.0, 0.0, 0.0)
    assert tie["set_fp32"][0] == 0 and tie["set_fp32"][1] in (1, 2)
    assert all(r["gap_fp32"] > 0.01 for r in row["router"] if r["layer"] != TIE_LAYER)
    assert (row["min_gap_fp32"], row["min_gap_layer"]) == (0.0, TIE_LAYER)


def test_a_split_at_output_zero_is_a_prefill_split() -> None:
    bf16, fp32 = build()
    ref, case = results([REF_OUT[0] + 1] + REF_OUT[1:])
    [row] = tool().analyse(bf16, fp32, ref, case)["splits"]
    assert (row["first"], row["position"], row["prefill"]) == (0, len(PROMPT) - 1, True)
    assert not any(r["flip"] for r in row["router"]) and row["flips_elsewhere"] == []


def test_text_prompts_are_encoded_and_a_token_count_mismatch_is_skipped() -> None:
    def rec(p: str, out: list[int], n: int) -> dict:
        return {"prompt": p, "output_ids": out, "meta": {"prompt_tokens": n}}

    # "f": CASE stopped early, no token differs: neither identical nor a split.
    ref = {"single": [rec("abc", [1, 2, 3], 3), rec("de", [1, 2], 5), rec("f", [1, 2, 3], 1)]}
    case = {"single": [rec("abc", [1, 9, 3], 3), rec("de", [4, 2], 5), rec("f", [1, 2], 1)]}
    splits, same, total = tool().find_splits(ref, case, lambda s: [ord(c) - 90 for c in s])
    assert (same, total) == (0, 3)
    [s] = splits
    assert (s.prompt_ids, s.first, s.position, s.prefix, s.case_token) == ([7, 8, 9], 1, 3, [7, 8, 9, 1], 9)
