"""tools/gpu/train_tiny_pair.py --smoke on CPU: the code paths run, and the checkpoints have SGLang's shape.

No acceptance number is asserted: 20 steps train nothing; the GPU run measures the real pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ddtree_deploy.benchmark.sweep import DEFAULT_PROMPTS, BenchArgs
from tests.gpu_tools import GPU_TOOLS, load_gpu_tool

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
SCRIPT = GPU_TOOLS / "train_tiny_pair.py"


def _script() -> ModuleType:
    return load_gpu_tool("train_tiny_pair")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pair")
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--smoke", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_smoke_run_writes_a_loadable_target_and_tokenizer(pair: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    code = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code  # byte-level: every byte round-trips
    target = AutoModelForCausalLM.from_pretrained(pair / "target")
    assert target.config.model_type == "qwen3" and target.config.vocab_size == len(tokenizer)
    log = json.loads((pair / "train_log.json").read_text())
    assert log["files"] > 0 and [e["phase"] for e in log["log"]][-1] == "drafter"
    assert log["draft_parameters_filled"] == 3 + 8 * log["config"]["draft_layers"]
    assert 1 <= log["chain_acceptance_bench_prompts"] <= log["config"]["block"]


def test_offline_rounds_on_the_bench_prompts_are_a_bench_baseline(pair: Path) -> None:
    """The bench's prompts decoded offline, read as `bench --baseline FILE=dflash` reads them: one greedy
    mean per prompt text, keyed as the server bench's own requests are."""
    from ddtree_deploy.benchmark.baseline import read_baseline

    baseline = read_baseline(f"{pair / 'dflash_offline_bench_prompts.json'}=dflash")
    assert set(baseline.requests["dflash"]) == {json.dumps(p) for p in DEFAULT_PROMPTS}
    log = json.loads((pair / "train_log.json").read_text())
    assert baseline.acceptance["dflash"].mean == log["chain_acceptance_bench_prompts"]
    corpus = read_baseline(f"{pair / 'dflash_offline_corpus.json'}=dflash")
    assert len(corpus.requests["dflash"]) == log["config"]["eval_prompts"]
    # bench_sweep.sh's --prompts: the same held-out windows, so the server's DFLASH compares per request
    prompts = json.loads((pair / "corpus_prompts.json").read_text())
    assert set(corpus.requests["dflash"]) == {json.dumps(p) for p in prompts}
    assert BenchArgs(prompts=prompts).prompts == prompts  # what `bench --prompts FILE` accepts


def test_draft_checkpoint_is_what_sglangs_dflash_loader_expects(pair: Path, tmp_path: Path) -> None:
    script = _script()
    draft = pair / "dflash_draft"
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["dflash_config"]["mask_token"] == "<|MASK|>"
    assert config["layer_types"] == ["full_attention"] and "is_causal" not in config  # SGLang: bidirectional
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    assert config["dflash_config"]["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|MASK|>")
    filled = script.check_draft_checkpoint(draft)
    assert filled["layers.0.self_attn.qkv_proj.weight"] == (2 + 2 * 1) * 32  # q, k and v rows stacked
    assert set(filled) == set(script.loader_parameters(config))

    # a weight the loader would skip (SGLang ignores unknown names silently) is caught
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((draft / "config.json").read_text())
    weights = load_file(str(draft / "model.safetensors"))
    weights["model.fc_in.weight"] = weights.pop("fc.weight")
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(AssertionError, match="the loader would ignore it"):
        script.check_draft_checkpoint(broken)


def test_blocks_see_what_sglangs_draft_forward_sees() -> None:
    """A block at anchor p sits at positions p..p+S-1 with the bonus tok[p] first, sees the context
    0..p-1 and all of its own block (SGLang's draft layers are ENCODER_ONLY), never another block."""
    script = _script()
    ids = torch.arange(100, 120)[None]
    block_ids, positions, visible = script.block_inputs(ids, torch.tensor([[3, 9]]), 4, 7, 20)
    assert block_ids.tolist() == [[103, 7, 7, 7, 109, 7, 7, 7]]
    assert positions.tolist() == [[3, 4, 5, 6, 9, 10, 11, 12]]
    ctx, blocks = visible[0, :, :20], visible[0, :, 20:]
    assert ctx.sum(1).tolist() == [3] * 4 + [9] * 4 and ctx[:4, :3].all() and ctx[4:, :9].all()
    assert blocks.tolist() == [[q // 4 == k // 4 for k in range(8)] for q in range(8)]
