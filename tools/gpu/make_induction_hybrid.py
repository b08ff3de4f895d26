#!/usr/bin/env python3
"""A hand-set Qwen3-Next hybrid whose next token depends on its recurrent state: an induction head
built from one GatedDeltaNet layer, for greedy equality tests that mean something on hybrids.

usage: PYTHONPATH=/tmp/site python3 make_induction_hybrid.py [OUT_DIR=/tmp/models]

Needs make_hybrid.py's OUT_DIR/hyb_copy (its tokenizer and config: hidden 256, vocab 1024, 5 GDN
layers and one attention layer, 64-wide heads, 2 key heads, 4 value heads). Writes OUT_DIR/hyb_induct.

On tokens 4..63 (TOKENS) the model predicts the token that followed the latest earlier occurrence of
the current token. The margin is about 15 nats, or 7 where a key was stored twice (beta 0.5 keeps
the older value at half the newer one's weight). A token never seen before is repeated, with a
margin of about 5.7. So "a b c d a" continues "b c d a b ...", and the same last token after another
history continues otherwise: the answer lives in layer 0's recurrent state, never in the current
token. The key reads only the conv's tap K-2, so a fault in the older taps of a conv window would
not show here.

How layer 0 does it (every other layer, and layer 0's experts, add nothing: their output
projections are zero). Embeddings are one-hot on dims 0..63, plus a constant on dim 64.
- q, k and v are the token's one-hot code. The depthwise conv takes the current position for q and
  v, and the previous one for k (tap K-2), so the delta rule stores value code(x_t) under key
  code(x_{t-1}).
- There is no decay (A_log -30, so g is about 0). beta is sigmoid(0) = 0.5, which shrinks a stored
  value but keeps its direction, and the gated RMSNorm undoes the scale.
- Reading with q = code(x_t) returns code(x_s) for the latest s with x_{s-1} = x_t. The gate z is
  the constant dim, so it is the same for every token.
- out_proj writes value head 0 to dims 128..191, and lm_head reads them (RETRIEVED), plus the
  current token's own dim at DEFAULT weight. With nothing retrieved, that repeats the token.
"""
import json
import shutil
import sys

import torch
from transformers import Qwen3NextForCausalLM

M = sys.argv[1] if len(sys.argv) > 1 else "/tmp/models"
TOKENS = range(4, 64)  # one-hot keys: no crosstalk between stored pairs
CODE, CONST, OUT = 64, 64, 128  # code width, the constant dim, where the retrieved code lands
RETRIEVED, DEFAULT, OUT_SCALE = 1.0, 0.5, 0.1


def set_layer0(attn, eye: torch.Tensor) -> None:
    """q, k, v = the one-hot code, z = the constant, for each key head's group of the fused projection."""
    kd, vd, nk, nv = attn.head_k_dim, attn.head_v_dim, attn.num_k_heads, attn.num_v_heads
    group = 2 * kd + 2 * vd * nv // nk
    w = torch.zeros_like(attn.in_proj_qkvz.weight)
    for g in range(nk):
        base = g * group
        w[base:base + CODE, :CODE] = eye  # q
        w[base + kd:base + kd + CODE, :CODE] = eye  # k
        for h in range(nv // nk):
            v0 = base + 2 * kd + h * vd
            w[v0:v0 + CODE, :CODE] = eye  # v
            z0 = base + 2 * kd + (nv // nk) * vd + h * vd
            w[z0:z0 + vd, CONST] = 1.0  # z: the constant dim, silu(z) the same for every token
    attn.in_proj_qkvz.weight.copy_(w)
    attn.in_proj_ba.weight.zero_()  # beta = sigmoid(0); a = 0
    attn.A_log.fill_(-30.0)  # g = -exp(A_log) * softplus(...) ~ 0: no decay
    conv = torch.zeros_like(attn.conv1d.weight)  # [q (nk*kd), k (nk*kd), v (nv*vd)] channels, K taps
    key_dim, taps = nk * kd, conv.shape[-1]
    conv[:key_dim, 0, taps - 1] = 1.0  # q: the current token
    conv[key_dim:2 * key_dim, 0, taps - 2] = 1.0  # k: the previous token
    conv[2 * key_dim:, 0, taps - 1] = 1.0  # v: the current token
    attn.conv1d.weight.copy_(conv)
    attn.norm.weight.fill_(1.0)
    out = torch.zeros_like(attn.out_proj.weight)
    out[OUT:OUT + CODE, :CODE] = OUT_SCALE * eye  # value head 0 -> dims 128..191
    attn.out_proj.weight.copy_(out)


def set_induction(model: Qwen3NextForCausalLM) -> Qwen3NextForCausalLM:
    """Overwrite `model`'s weights with the induction head (layer 0 must be a GDN layer)."""
    eye = torch.eye(CODE)
    with torch.no_grad():
        emb = torch.zeros_like(model.model.embed_tokens.weight)
        emb[:CODE, :CODE] = eye
        emb[:, CONST] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        for name, p in model.named_parameters():
            if any(s in name for s in ("o_proj", "out_proj", "down_proj")):
                p.zero_()
        set_layer0(model.model.layers[0].linear_attn, eye)
        head = torch.zeros_like(model.lm_head.weight)
        head[:CODE, OUT:OUT + CODE] = RETRIEVED * eye
        head[:CODE, :CODE] += DEFAULT * eye
        model.lm_head.weight.copy_(head)
    return model


def main() -> None:
    model = set_induction(Qwen3NextForCausalLM.from_pretrained(f"{M}/hyb_copy", dtype=torch.float32))
    dst = f"{M}/hyb_induct"
    model.to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{M}/hyb_copy/{f}", dst)
    path = f"{dst}/config.json"
    config = json.load(open(path))
    config["full_attention_interval"] = json.load(open(f"{M}/hyb_copy/config.json"))["full_attention_interval"]
    json.dump(config, open(path, "w"), indent=1)
    print("hyb_induct: induction head in layer 0 on tokens", TOKENS.start, "..", TOKENS.stop - 1)


if __name__ == "__main__":
    main()
