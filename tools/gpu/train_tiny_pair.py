#!/usr/bin/env python3
"""Train a tiny target and its DFlash drafter on the Python standard library's own sources (seeded).

    python tools/gpu/train_tiny_pair.py --out /tmp/models/trained            # the H200 run (a few minutes)
    python tools/gpu/train_tiny_pair.py --out /tmp/tiny --smoke --device cpu  # 20 steps each: the code paths

What it writes under --out:

- `target/`: a Qwen3ForCausalLM (few layers, bf16 safetensors) and its tokenizer, a byte-level BPE
  trained with `tokenizers` on the same sources (specials `<|endoftext|>`, `<|im_start|>`,
  `<|im_end|>`, `<|MASK|>`), trained as a plain next-token model.
- `dflash_draft/`: a drafter in SGLang 0.5.17's `DFlashDraftModel` format (srt/models/dflash.py;
  shared/GPU.md lists the fields): `architectures: ["DFlashDraftModel"]`, `model_type: qwen3`,
  the target's `hidden_size` (the draft borrows its embedding and lm_head), `block_size`,
  `num_target_layers`, `dflash_config: {target_layer_ids, mask_token, mask_token_id}`; weights
  `layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.{gate,up,down}_proj`, the two
  layer norms, `norm`, `fc` `[hidden, K*hidden]` and `hidden_norm`. The loader silently ignores a
  name it does not know, so `check_draft_checkpoint` proves every weight lands on a parameter.
- `corpus_prompts.json`: the held-out corpus windows (64 token ids each) that `bench_sweep.sh` benches
  on, text like the drafter's training data (on the bench's short prose prompts acceptance is near 1).
- `dflash_offline_{corpus,bench_prompts}.json`: offline DFLASH rounds (greedy, torch, the drafter
  loaded back from its checkpoint) on those windows and on the bench's `DEFAULT_PROMPTS`, 128 new
  tokens each, in the bench's JSON schema: a server bench's `--baseline FILE=dflash` (its requests
  agree with the server's until the first bf16 near-tie, run 18).
- `train_log.json`: the arguments, corpus size, losses, both acceptance means.

The drafter is distilled from the target: sequences are the target's own greedy continuations of
corpus prompts of several lengths (down to a few tokens, as the bench's prompts are: the server
drafts from every context length a request passes through), its features are the target's hidden states at
`target_layer_ids` (the output of layer k, which SGLang captures as `layers_to_capture = k + 1`, i.e.
transformers' `hidden_states[k + 1]`), and it learns to predict the target's next S - 1 tokens from the
context's features and a block `[bonus, MASK x (S-1)]`, as SGLang runs it: context K/V from
`hidden_norm(fc(features))` (k_norm and RoPE at the context positions, no layer norm), block queries
attending to the context before the block and to the whole block (SGLang's draft layers are
ENCODER_ONLY, i.e. bidirectional), the target's lm_head on the draft's final norm, block positions
1..S-1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
#: Shared by the target, the drafter and the drafter's config.json (SGLang builds the draft's RoPE and
#: norms from that file: dflash.py DFlashAttention reads `get_rope_config`, `rms_norm_eps`, `head_dim`).
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
MAX_POSITIONS = 4096


@dataclass
class Config:
    seed: int = 0
    vocab: int = 4096
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64
    target_layer_ids: tuple[int, ...] = (1, 4)  # each < layers - 1: SGLang captures the input of layer k + 1
    draft_layers: int = 2
    block: int = 16
    seq: int = 256
    batch: int = 64
    target_steps: int = 3000
    target_lr: float = 1e-3
    prompt_lens: tuple[int, ...] = (4, 8, 16, 32, 64)  # distillation prompts, cycled; eval windows: the longest
    distill_sequences: int = 4096
    distill_new_tokens: int = 192
    draft_steps: int = 3000
    draft_lr: float = 6e-4
    anchors: int = 16  # blocks per sequence per draft step
    eval_prompts: int = 16  # held-out corpus windows: the offline evaluation and the sweep's prompts
    eval_new_tokens: int = 128
    max_corpus_mb: float = 48.0
    max_files: int = 0  # 0: every file

    @property
    def intermediate(self) -> int:
        return 3 * self.hidden

    @classmethod
    def smoke(cls) -> Config:
        return cls(vocab=512, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, target_layer_ids=(0, 2),
                   draft_layers=1, block=8, seq=64, batch=8, target_steps=20, prompt_lens=(4, 16), distill_sequences=16,
                   distill_new_tokens=32, draft_steps=20, anchors=4, eval_prompts=2, eval_new_tokens=16,
                   max_corpus_mb=1.0, max_files=40)


# --------------------------------------------------------------------------- corpus and tokenizer
def stdlib_sources(cfg: Config) -> list[str]:
    """The standard library's .py files (site-packages excluded), sorted, up to the size cap."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    texts, total = [], 0
    for path in paths[: cfg.max_files or None]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total > cfg.max_corpus_mb * 1e6:
            break
    return texts


def train_tokenizer(texts: list[str], cfg: Config):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|MASK|>")


def encode(texts: list[str], tokenizer) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


def windows(tokens: torch.Tensor, length: int, count: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - length - 1, (count,), generator=gen)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])


# --------------------------------------------------------------------------- target
def make_target(cfg: Config, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    conf = Qwen3Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=RMS_EPS,
                       tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                       torch_dtype="bfloat16")
    if hasattr(conf, "rope_parameters"):  # transformers 5.x names it so; SGLang reads either
        conf.rope_parameters = {"rope_type": "default", "rope_theta": ROPE_THETA}
    return Qwen3ForCausalLM(conf)


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def train_target(model, tokens: torch.Tensor, cfg: Config, device: str, log: list[dict]) -> None:
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.target_lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    for step in range(cfg.target_steps):
        batch = windows(tokens, cfg.seq + 1, cfg.batch, gen).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.target_steps, cfg.target_lr)
        with _autocast(device):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        _step(opt, model.parameters(), loss)
        _log(log, "target", step, cfg.target_steps, loss)
    model.eval()


def _step(opt: torch.optim.Optimizer, params, loss: torch.Tensor) -> None:
    """One optimiser step of either model: gradients of `loss`, clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)


def _log(log: list[dict], what: str, step: int, steps: int, loss: torch.Tensor) -> None:
    if step % max(1, steps // 20) == 0 or step == steps - 1:
        log.append({"phase": what, "step": step, "loss": round(float(loss), 4)})
        print(f"{what} step {step}/{steps} loss {float(loss):.3f}", flush=True)


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, chunk: int = 256) -> torch.Tensor:
    """The target's own greedy continuations (prompt + new tokens), batched, with its KV cache. An
    end-of-text token is decoded like any other (the bench sends ignore_eos), never suppressed."""
    from transformers import DynamicCache

    outs = []
    for rows in prompts.split(chunk):
        cache, seq, step = DynamicCache(), rows, rows
        for _ in range(new_tokens):
            step = model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, step], dim=1)
        outs.append(seq)
    return torch.cat(outs)


def distill_rows(model, prompts: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy continuations of `prompts` ([N, max(prompt_lens)] corpus windows), row i cut to
    `prompt_lens[i % len]` tokens and continued to `max(prompt_lens) + distill_new_tokens` in all: the
    rows [N, T] and each row's first generated position [N]. Several lengths, because the server drafts
    from every context length a request passes through, from its prompt on (the bench's prompts are
    short: tens of tokens at most), where 64-token prompts alone never trained a context below 64."""
    total = max(cfg.prompt_lens) + cfg.distill_new_tokens
    starts = torch.tensor([cfg.prompt_lens[i % len(cfg.prompt_lens)] for i in range(len(prompts))],
                          device=prompts.device)
    rows = torch.empty(len(prompts), total, dtype=prompts.dtype, device=prompts.device)
    for length in cfg.prompt_lens:
        pick = (starts == length).nonzero().squeeze(1)
        if len(pick):  # fewer sequences than lengths leaves some out
            rows[pick] = greedy_continuations(model, prompts[pick, :length], total - length)
    return rows, starts


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Concatenated outputs of layers `layer_ids` ([B, T, K*H]): what SGLang's DFLASH captures."""
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[k + 1] for k in layer_ids], dim=-1)


# --------------------------------------------------------------------------- drafter (SGLang's DFlashDraftModel)
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = RMS_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SGLang's order (layernorm.py RMSNorm.forward_native, cast_x_before_out_mul off): the weight
        multiplies in float32, then one cast back to the input's dtype (HF casts before the weight)."""
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Neox-style rotary embedding (SGLang's default for Qwen3): x [B, heads, N, D], positions [B, N]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim)
        self.k_norm = RMSNorm(cfg.head_dim)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def kv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = rope(self.k_norm(self._split(self.k_proj(h), self.kv_heads)), positions)
        return k, self._split(self.v_proj(h), self.kv_heads)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor, ctx_positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        q = rope(self.q_norm(self._split(self.q_proj(h), self.heads)), positions)
        k_ctx, v_ctx = self.kv(ctx, ctx_positions)  # context K/V straight from the projected features
        k_blk, v_blk = self.kv(h, positions)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        repeat = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                             attn_mask=mask[:, None])  # bool: True where visible
        return self.o_proj(out.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg)


class Drafter(nn.Module):
    """Parameter names are the checkpoint's: `layers.{i}.*`, `norm`, `fc`, `hidden_norm`."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.draft_layers))
        self.norm = RMSNorm(cfg.hidden)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden, cfg.hidden, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """block_embeds [B, N, H] at `positions` [B, N]; features [B, T, K*H] at 0..T-1; mask [B, N, T + N]
        (bool, True where a block query sees a context token or a block token)."""
        ctx = self.hidden_norm(self.fc(features))
        ctx_positions = torch.arange(ctx.shape[1], device=ctx.device).expand(ctx.shape[0], -1)
        x = block_embeds
        for layer in self.layers:  # pre-norm residual, as SGLang's fused residual RMSNorm computes it
            x = x + layer.self_attn(layer.input_layernorm(x), positions, ctx, ctx_positions, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int, context: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks `[tok[p], MASK...]` at anchors p ([B, A]): their ids and positions ([B, A*S]) and the mask
    ([B, A*S, context + A*S], bool): a block sees the context before its anchor and the whole of itself.
    That is SGLang's draft forward: positions `seq_lens + 0..S-1` (dflash_worker_v2.py, the block
    prepare), the committed tokens 0..p-1 from the KV cache as prefix, and a non-causal extend over the
    block (dflash.py `_get_dflash_layer_attention_params`: ENCODER_ONLY; triton_backend.py: causal off)."""
    b, a = anchors.shape
    offsets = torch.arange(block, device=ids.device)
    positions = (anchors[:, :, None] + offsets).reshape(b, a * block)
    block_ids = torch.full((b, a, block), mask_id, device=ids.device, dtype=ids.dtype)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    ctx_ok = torch.arange(context, device=ids.device)[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
    which = torch.arange(a, device=ids.device).repeat_interleave(block)
    own = which[:, None] == which[None, :]
    visible = torch.cat([ctx_ok, own.expand(b, -1, -1)], dim=-1)
    return block_ids.reshape(b, a * block), positions, visible


def train_drafter(drafter: Drafter, target, seqs: torch.Tensor, starts: torch.Tensor, cfg: Config, mask_id: int,
                  device: str, log: list[dict]) -> None:
    """`seqs` [N, T] from `distill_rows`, generated from `starts` [N] on: a block's anchor p (its bonus
    token) lies in [start, T - S], so the bonus and the labels are the target's own greedy tokens."""
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    embed, head = target.get_input_embeddings(), target.lm_head
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.draft_lr, weight_decay=0.01)
    s = cfg.block
    weights = torch.exp(-torch.arange(s - 1, device=device, dtype=torch.float32) / (s / 2))  # nearer depths matter more
    drafter.train()
    for step in range(cfg.draft_steps):
        pick = torch.randint(0, len(seqs), (cfg.batch,), generator=gen)
        rows, lo = seqs[pick].to(device), starts[pick].cpu()
        span = seqs.shape[1] - s - lo + 1  # anchors lo .. T - S, uniformly
        anchors = (lo[:, None] + (torch.rand(cfg.batch, cfg.anchors, generator=gen) * span[:, None]).long()).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.draft_steps, cfg.draft_lr)
        with torch.no_grad(), _autocast(device):
            features = target_features(target, rows, cfg.target_layer_ids)
            block_ids, positions, mask = block_inputs(rows, anchors, s, mask_id, rows.shape[1])
            embeds = embed(block_ids)
        with _autocast(device):
            hidden = drafter(embeds, positions, features, mask)
            logits = head(hidden).float().view(cfg.batch, cfg.anchors, s, -1)[:, :, 1:]
        labels = rows.gather(1, (anchors[:, :, None] + torch.arange(1, s, device=device)).reshape(cfg.batch, -1))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (loss.view(cfg.batch, cfg.anchors, s - 1) * weights).sum() / (weights.sum() * cfg.batch * cfg.anchors)
        _step(opt, drafter.parameters(), loss)
        _log(log, "drafter", step, cfg.draft_steps, loss)
    drafter.eval()


@torch.no_grad()
def chain_acceptance(drafter: Drafter, target, prompts: list[torch.Tensor], cfg: Config, mask_id: int, device: str
                     ) -> list[list[int]]:
    """DFLASH's greedy round offline (no cache: each round recomputes the context): per prompt (1-D
    token ids, any length), each round's acceptance length (accepted drafts + the bonus) until
    `eval_new_tokens` are out, the prefill's token counted as the server's completion_tokens counts it."""
    s = cfg.block
    out = []
    for prompt in prompts:
        seq = prompt.to(device)[None]
        with _autocast(device):
            bonus = target(input_ids=seq).logits[0, -1].argmax()
        seq, lengths = torch.cat([seq, bonus.view(1, 1)], dim=1), []
        while seq.shape[1] - len(prompt) < cfg.eval_new_tokens:
            p = seq.shape[1] - 1  # the bonus token's position
            with _autocast(device):
                features = target_features(target, seq[:, :p], cfg.target_layer_ids)
                block_ids, positions, mask = block_inputs(seq, torch.tensor([[p]], device=device), s, mask_id, p)
                hidden = drafter(target.get_input_embeddings()(block_ids), positions, features, mask)
                drafts = target.lm_head(hidden)[0, 1:].argmax(-1)
                picks = target(input_ids=torch.cat([seq, drafts[None]], dim=1)).logits[0, p:].argmax(-1)
            accepted = int((drafts == picks[:-1]).long().cumprod(0).sum())
            seq = torch.cat([seq, drafts[None, :accepted], picks[accepted].view(1, 1)], dim=1)
            lengths.append(accepted + 1)
        out.append(lengths)
    return out


def offline_results(lengths: list[list[int]], prompts: list, cfg: Config, note: str):  # -> BenchResults
    """Offline rounds in the bench's JSON schema (variant `dflash`, greedy, batch 1, one request per
    prompt) and with its arithmetic (`acceptance_of`: mean over requests, pooled histogram), so a
    server bench compares with it request by request: `ddtree-deploy bench --baseline FILE=dflash`."""
    from ddtree_deploy.benchmark.results import BenchResults, RequestStats, RunResult, VariantResult, acceptance_of

    requests = [RequestStats(prompt=i, completion_tokens=cfg.eval_new_tokens, rounds=len(x),
                             accept_counts=[x.count(b) for b in range(1, cfg.block + 1)])
                for i, x in enumerate(lengths)]
    run = RunResult(mode="greedy", batch=1, temperature=0.0, requests=requests,
                    completion_tokens=sum(r.completion_tokens for r in requests), elapsed_s=0.0, tokens_per_s=0.0,
                    acceptance=acceptance_of(requests, cfg.block))
    return BenchResults(source="train_tiny_pair", model="trained tiny pair (offline, torch)", block_size=cfg.block,
                        max_new_tokens=cfg.eval_new_tokens, batch=1, prompts=prompts, note=note,
                        variants=[VariantResult(variant="dflash", algorithm="DFLASH", runs=[run])])


# --------------------------------------------------------------------------- checkpoints
def save_draft(drafter: Drafter, cfg: Config, folder: Path, vocab: int, mask_id: int) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.draft_layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": RMS_EPS, "attention_bias": False,
        "max_position_embeddings": MAX_POSITIONS, "rope_theta": ROPE_THETA,  # transformers 4 reads this,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},  # 5 this (SGLang: either)
        # full_attention and no `is_causal`: SGLang then makes every draft layer ENCODER_ONLY (dflash.py
        # _get_dflash_layer_attention_params), the bidirectional block `block_inputs` trains
        "layer_types": ["full_attention"] * cfg.draft_layers,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": cfg.block,
        "num_target_layers": cfg.layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token": "<|MASK|>",
                          "mask_token_id": mask_id},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_draft(folder: Path, cfg: Config, device: str) -> Drafter:
    """The drafter as the server holds it: the checkpoint's bf16 weights (held in float32 on CPU, where
    bf16 matmuls are slow; the values stay bf16's), so the offline numbers are the checkpoint's own."""
    from safetensors.torch import load_file

    drafter = Drafter(cfg)
    drafter.load_state_dict(load_file(str(folder / "model.safetensors")))
    return drafter.to(device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16).eval()


def loader_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters SGLang 0.5.17's DFlashDraftModel has (srt/models/dflash.py, tp = 1), with shapes."""
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config[
        "head_dim"]
    inter, k = config["intermediate_size"], len(config["dflash_config"]["target_layer_ids"])
    params: dict[str, tuple[int, ...]] = {"norm.weight": (h,), "fc.weight": (h, k * h), "hidden_norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        params.update({p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * d, h),
                       p + "self_attn.o_proj.weight": (h, heads * d), p + "self_attn.q_norm.weight": (d,),
                       p + "self_attn.k_norm.weight": (d,), p + "mlp.gate_up_proj.weight": (2 * inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return params


#: dflash.py's `stacked_params_mapping`: (checkpoint name part, parameter name part, rows it fills)
STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj"}


def check_draft_checkpoint(folder: Path) -> dict[str, int]:
    """Load the checkpoint as DFlashDraftModel.load_weights resolves names: every weight must land on a
    parameter (the loader skips unknown names silently), every parameter must be filled, rows must add up."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] >= 2, config
    ids = config["dflash_config"]["target_layer_ids"]
    # k + 1 is captured (qwen3.py set_dflash_layers_to_capture), so k = L - 1 would capture nothing; the
    # captures concatenate in layer order (qwen2.py Qwen2Model.forward), `target_features` in list order
    assert ids == sorted(set(ids)) and all(0 <= i < config["num_target_layers"] - 1 for i in ids), ids
    assert not config.get("is_causal") and set(config.get("layer_types") or ["full_attention"]) == {
        "full_attention"}, "SGLang would run the block causally or windowed; the drafter is trained bidirectional"
    expected = loader_parameters(config)
    filled: dict[str, int] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        part = next((w for w in STACKED if f".{w}." in name), None)
        param = name.replace(part, STACKED[part]) if part else name
        param = param.removeprefix("model.") if param not in expected else param  # the loader strips it too
        if param not in expected:
            raise AssertionError(f"{name}: the loader would ignore it (no parameter {param})")
        want = expected[param]
        assert tensor.shape[1:] == want[1:] or (len(want) == 1 and tuple(tensor.shape) == want), (name, tensor.shape)
        filled[param] = filled.get(param, 0) + tensor.shape[0]
    wrong = {p: (filled.get(p), s[0]) for p, s in expected.items() if filled.get(p) != s[0]}
    assert not wrong, f"parameters not filled exactly: {wrong}"
    return filled


# --------------------------------------------------------------------------- main
def evaluate(drafter: Drafter, target, tokenizer, held_out: list[list[int]], cfg: Config, mask_id: int, device: str,
             out: Path) -> list:  # -> [Acceptance, Acceptance]
    """Offline DFLASH rounds on the held-out corpus prompts and on the bench's default prompts, each
    written as `out/dflash_offline_{corpus,bench_prompts}.json` (bench schema); their acceptances."""
    from ddtree_deploy.benchmark.sweep import DEFAULT_PROMPTS

    found = []
    for name, prompts in (("corpus", held_out), ("bench_prompts", list(DEFAULT_PROMPTS))):
        ids = [token_ids(p, tokenizer).to(device) for p in prompts]
        results = offline_results(chain_acceptance(drafter, target, ids, cfg, mask_id, device), prompts, cfg,
                                  f"offline DFLASH rounds (torch, greedy) on the {name.replace('_', ' ')}")
        (out / f"dflash_offline_{name}.json").write_text(results.model_dump_json(by_alias=True, indent=1) + "\n")
        found.append(results.variants[0].acceptance)
    return found


def token_ids(prompt: str | list[int], tokenizer) -> torch.Tensor:
    """A bench prompt as the server sees it: text through the target's tokenizer, as SGLang's tokenizer
    manager encodes it (no special tokens added: this tokenizer has no BOS), token ids as they are."""
    return torch.tensor(prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 20 steps each: the code paths only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int)
    parser.add_argument("--draft-steps", type=int)
    parser.add_argument("--block", type=int, help="the draft block size S (default 16; smoke 8)")
    options = parser.parse_args()
    cfg = Config.smoke() if options.smoke else Config()
    for name in ("target_steps", "draft_steps", "block"):
        if getattr(options, name) is not None:
            setattr(cfg, name, getattr(options, name))
    cfg.seed = options.seed
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    started, log = time.time(), []

    texts = stdlib_sources(cfg)
    tokenizer = train_tokenizer(texts, cfg)
    tokens = encode(texts, tokenizer)
    mask_id = tokenizer.convert_tokens_to_ids("<|MASK|>")
    print(f"corpus: {len(texts)} files, {len(tokens)} tokens, vocab {len(tokenizer)}", flush=True)

    target = make_target(cfg, tokenizer).to(options.device)
    train_target(target, tokens, cfg, options.device, log)
    target_dir = options.out / "target"
    target.to(torch.bfloat16).save_pretrained(target_dir, safe_serialization=True)
    tokenizer.save_pretrained(target_dir)
    target.to(torch.float32 if options.device == "cpu" else torch.bfloat16)  # CPU matmuls in bf16 are slow

    gen = torch.Generator().manual_seed(cfg.seed + 3)
    prompts = windows(tokens, max(cfg.prompt_lens), cfg.distill_sequences + cfg.eval_prompts, gen).to(options.device)
    seqs, starts = distill_rows(target, prompts[: cfg.distill_sequences], cfg)
    drafter = Drafter(cfg).to(options.device)
    train_drafter(drafter, target, seqs, starts, cfg, mask_id, options.device, log)
    draft_dir = options.out / "dflash_draft"
    save_draft(drafter, cfg, draft_dir, len(tokenizer), mask_id)
    filled = check_draft_checkpoint(draft_dir)

    held_out = [p.tolist() for p in prompts[cfg.distill_sequences:]]
    (options.out / "corpus_prompts.json").write_text(json.dumps(held_out) + "\n")
    corpus, bench = evaluate(load_draft(draft_dir, cfg, options.device), target, tokenizer, held_out, cfg, mask_id,
                             options.device, options.out)
    summary = {"config": asdict(cfg), "device": options.device, "files": len(texts), "tokens": len(tokens),
               "draft_parameters_filled": len(filled), "chain_acceptance_offline": corpus.mean,
               "chain_acceptance_bench_prompts": bench.mean, "p_tau1_bench_prompts": bench.histogram[0],
               "seconds": round(time.time() - started, 1), "log": log}
    (options.out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"offline chain acceptance (greedy, block {cfg.block}): {corpus.mean:.2f} on {len(held_out)} held-out "
          f"corpus prompts, {bench.mean:.2f} on the bench's prompts (P(tau=1) {bench.histogram[0]:.2f}); "
          f"wrote {options.out} in {summary['seconds']}s", flush=True)


if __name__ == "__main__":
    main()
