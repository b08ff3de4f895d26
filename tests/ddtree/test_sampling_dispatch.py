"""ddtree 0.3.0-rc.6's worker-level sampling dispatch (`_sample_picks`, `_sample_joint_picks`), lifted
from the overlay's own ddtree_worker_v2.py and run on the CPU: which rule each batch gets, per
sampling backend, and that the torch joint path samples every node from plain decoding's distribution
(the release's torch sampler, `plain_distribution`) when it works a few requests at a time.

The worker imports SGLang's whole server stack, so only these two methods are lifted. flashinfer's
sampling kernel needs CUDA: a recording stand-in (in this test only) checks what the flashinfer path
hands it; that the kernel is plain decoding's rule is sampler.py's own call, run on the GPU by
tools/gpu/ddtree_run.sh's samp_* cases."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ddtree.test_sampling_joint import RC6, SAMPLING, repeated
from tests.ddtree.test_sampling_rules import NODES, TOP_K_ALL, VOCAB, batch_info

WORKER = "sglang/srt/speculative/ddtree_worker_v2.py"
METHODS = ("_sample_picks", "_sample_joint_picks")


class Recorder:
    """Stand-ins for SGLang's dense verify probabilities and Gumbel sampler, and flashinfer's
    joint kernel: each records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.sampled_from: list[torch.Tensor] = []

    def dense_probs(self, **kwargs: Any) -> torch.Tensor:
        self.calls.append(("dense", kwargs))
        return torch.full((kwargs["bs"] * kwargs["draft_token_num"], VOCAB), 1.0 / VOCAB)

    def fast_sample(self, probs: torch.Tensor, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.sampled_from.append(probs.clone())
        index = torch.multinomial(probs.float(), num_samples)
        return probs.gather(1, index), index

    def flashinfer_joint(self, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         filter_apply_order: str) -> torch.Tensor:
        self.calls.append(("flashinfer", (probs.clone(), top_k.clone(), top_p.clone(), filter_apply_order)))
        return torch.zeros(probs.shape[0], dtype=torch.int32)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "flashinfer", ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.sampling",
                        SimpleNamespace(top_k_top_p_sampling_from_probs=rec.flashinfer_joint))
    yield rec


def lifted(decode_tool: ModuleType, recorder: Recorder, backend: str) -> Any:
    """A worker carrying rc.6's two sampling methods, on a server whose sampling backend is `backend`."""
    from ddtree_deploy.catalog import load_overlay

    source = load_overlay(RC6, decode_tool.OVERLAYS).content_of(WORKER, None).decode()
    worker = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DDTreeWorkerV2")
    worker.body = [n for n in worker.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    worker.bases, worker.decorator_list = [], []
    sampling = decode_tool.load_overlay_module(RC6, SAMPLING)
    namespace: dict[str, Any] = {
        "torch": torch, "build_dflash_verify_target_probs": recorder.dense_probs, "fast_sample": recorder.fast_sample,
        "get_exec": lambda: SimpleNamespace(kernel=SimpleNamespace(sampling_backend=backend)),
        **{name: getattr(sampling, name) for name in sampling.__all__},
    }
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    exec(compile(ast.fix_missing_locations(ast.Module(body=[future, worker], type_ignores=[])), WORKER, "exec"),
         namespace)
    instance = namespace["DDTreeWorkerV2"]()
    instance.verify_width = NODES
    return instance


def draft_input(info: SimpleNamespace) -> SimpleNamespace:
    top_ks = [int(k) for k in info.top_ks]
    return SimpleNamespace(max_top_k=max(top_ks), uniform_top_k_value=top_ks[0] if len(set(top_ks)) == 1 else None)


def flags(info: SimpleNamespace, need_top_k: bool, need_top_p: bool) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(info), "need_top_k_sampling": need_top_k, "need_top_p_sampling": need_top_p})


@pytest.mark.parametrize("backend", ["pytorch", "flashinfer"])
@pytest.mark.parametrize(("top_ks", "need_top_k", "need_top_p", "path"), [
    ([TOP_K_ALL] * 3, False, False, "dense"),  # temperature only
    ([TOP_K_ALL] * 3, False, True, "dense"),  # top-p only: SGLang's rule is plain's
    ([TOP_K_ALL, 8, 4], True, False, "dense"),  # top-k only, one request without: the whole vocabulary
    ([8, 3, 20], True, False, "sparse"),  # top-k only, every request below V
])
def test_with_at_most_one_cut_the_rule_is_rc5s(decode_tool: ModuleType, recorder: Recorder, backend: str,
                                               top_ks: list[int], need_top_k: bool, need_top_p: bool, path: str,
                                               make_logits: Callable[..., torch.Tensor]) -> None:
    info = flags(batch_info(top_ks, [0.9, 0.9, 0.9] if need_top_p else [1.0] * 3), need_top_k, need_top_p)
    logits = make_logits("flat", (3 * NODES, VOCAB), 3).float()
    picks = lifted(decode_tool, recorder, backend)._sample_picks(info, draft_input(info), logits, 3)
    assert picks.shape == (3 * NODES, 1)
    assert [name for name, _ in recorder.calls] == (["dense"] if path == "dense" else [])
    if path == "sparse":
        assert recorder.sampled_from[0].shape == (3 * NODES, 20)  # the top 20 only, no dense block


def test_on_flashinfer_both_cuts_go_to_plain_decodings_own_kernel(decode_tool: ModuleType, recorder: Recorder,
                                                                  make_logits: Callable[..., torch.Tensor]) -> None:
    info = flags(batch_info([20, 5, TOP_K_ALL], [0.95, 0.5, 0.8]), True, True)
    logits = make_logits("bf16", (3 * NODES, VOCAB), 11).float()
    picks = lifted(decode_tool, recorder, "flashinfer")._sample_picks(info, draft_input(info), logits, 3)
    assert picks.dtype == torch.int64 and picks.shape == (3 * NODES, 1)
    [(name, (probs, top_ks, top_ps, order))] = recorder.calls
    want_probs, _, want_top_ps = repeated(info, logits)
    assert name == "flashinfer" and order == "joint"
    assert torch.allclose(probs, want_probs, atol=1e-7)  # softmax(logits / T) at every node, as plain decoding
    assert torch.equal(top_ks, torch.repeat_interleave(info.top_ks, NODES)) and torch.equal(top_ps, want_top_ps)
    assert recorder.sampled_from == []


@pytest.mark.parametrize("chunk", [1 << 26, 3 * NODES * VOCAB // 2], ids=["one-chunk", "two-chunks"])
@pytest.mark.parametrize("top_ks", [[8, 3, 20], [TOP_K_ALL, 6, 30]], ids=["below-V", "one-unset"])
def test_on_pytorch_both_cuts_sample_every_node_as_plain_decoding(
        decode_tool: ModuleType, recorder: Recorder, plain_distribution: Callable[..., torch.Tensor],
        make_logits: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch, chunk: int,
        top_ks: list[int]) -> None:
    sampling = decode_tool.load_overlay_module(RC6, SAMPLING)
    monkeypatch.setattr(sampling, "JOINT_CHUNK_ELEMENTS", chunk)
    info = flags(batch_info(top_ks, [0.5, 0.9, 0.8]), True, True)
    logits = make_logits("flat", (3 * NODES, VOCAB), 17).float()  # no exact ties: token identity is compared
    worker = lifted(decode_tool, recorder, "pytorch")
    torch.manual_seed(0)
    picks = worker._sample_picks(info, draft_input(info), logits, 3)
    k = VOCAB if TOP_K_ALL in top_ks else 20
    rows = [block.shape[0] for block in recorder.sampled_from]
    assert rows == ([3 * NODES] if chunk == 1 << 26 else [NODES, NODES, NODES] if k == VOCAB else [3 * NODES])
    assert recorder.calls == [] and picks.shape == (3 * NODES, 1)
    # The probabilities each node was drawn from, mapped back to token ids, are plain decoding's.
    order = torch.topk(logits / torch.repeat_interleave(info.temperatures, NODES, dim=0), k, dim=-1).indices
    drawn = torch.zeros_like(logits).scatter(1, order, torch.cat(recorder.sampled_from))
    assert torch.allclose(drawn, plain_distribution(*repeated(info, logits)), atol=1e-6)
    assert bool((drawn.gather(1, picks) > 0).all())  # every pick is a kept token
