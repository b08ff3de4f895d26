"""ddtree 0.3.0-rc.6's worker-level sampling dispatch (`_sample_picks`, `_sample_flashinfer_picks`), lifted
from the overlay's own ddtree_worker_v2.py and run on the CPU: which rule each batch gets, per
sampling backend, and that the torch joint path samples every node from plain decoding's distribution
(the release's torch sampler, `plain_distribution`) when it works a few requests at a time.

The worker imports SGLang's whole server stack, so only these methods are lifted. flashinfer's
sampling kernels need CUDA: recording stand-ins (in this test only) for the four functions of
sampler.py's flashinfer branch check what the worker hands them; that they are plain decoding's rule
is sampler.py's own call, run on the GPU by tools/gpu/ddtree_run.sh's samp_fi_* cases."""

from __future__ import annotations

import ast
from collections.abc import Callable
from functools import partial
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ddtree.test_sampling_joint import RC6, SAMPLING, repeated
from tests.ddtree.test_sampling_rules import NODES, TOP_K_ALL, VOCAB, batch_info

WORKER = "sglang/srt/speculative/ddtree_worker_v2.py"
METHODS = ("_sample_picks", "_sample_flashinfer_picks")


class Recorder:
    """Stand-ins for SGLang's dense verify probabilities, its Gumbel sampler and the flashinfer
    functions sampler.py imports: each records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.sampled_from: list[torch.Tensor] = []

    def dense_probs(self, **kwargs: Any) -> torch.Tensor:
        self.calls.append(("dense", ()))
        return torch.full((kwargs["bs"] * kwargs["draft_token_num"], VOCAB), 1.0 / VOCAB)

    def fast_sample(self, probs: torch.Tensor, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.sampled_from.append(probs.clone())
        index = torch.multinomial(probs.float(), num_samples)
        return probs.gather(1, index), index

    def kernel(self, name: str, result: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(probs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls.append((name, (probs.clone(), *args, *kwargs.values())))
            return result(probs)

        return call

    def plain_sampler(self) -> SimpleNamespace:
        picks = lambda probs: torch.zeros(probs.shape[0], dtype=torch.int32)  # noqa: E731
        return SimpleNamespace(
            top_k_top_p_sampling_from_probs=self.kernel("joint", picks),
            top_k_renorm_prob=self.kernel("top_k_renorm", lambda probs: probs),
            top_p_renorm_prob=self.kernel("top_p_renorm", lambda probs: probs),
            min_p_sampling_from_probs=self.kernel("min_p", picks),
        )


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


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
        "plain_sampler": recorder.plain_sampler(), "partial": partial,
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


def flags(info: SimpleNamespace, need_top_k: bool, need_top_p: bool, need_min_p: bool = False) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(info), "need_top_k_sampling": need_top_k, "need_top_p_sampling": need_top_p,
                              "need_min_p_sampling": need_min_p, "min_ps": torch.zeros(len(info.top_ks))})


ONE_CUT = [  # (top_ks, need_top_k, need_top_p, rc.5's path on a torch server)
    ([TOP_K_ALL] * 3, False, True, "dense"),  # top-p only: SGLang's rule is plain's
    ([TOP_K_ALL, 8, 4], True, False, "dense"),  # top-k only, one request without: the whole vocabulary
    ([8, 3, 20], True, False, "sparse"),  # top-k only, every request below V
]


def picks_of(decode_tool: ModuleType, recorder: Recorder, backend: str, info: SimpleNamespace,
             logits: torch.Tensor) -> torch.Tensor:
    picks = lifted(decode_tool, recorder, backend)._sample_picks(info, draft_input(info), logits, 3)
    assert picks.dtype == torch.int64 and picks.shape == (3 * NODES, 1)
    return picks


@pytest.mark.parametrize("backend", ["pytorch", "flashinfer"])
def test_temperature_alone_samples_sglangs_dense_probabilities(decode_tool: ModuleType, recorder: Recorder,
                                                               backend: str,
                                                               make_logits: Callable[..., torch.Tensor]) -> None:
    info = flags(batch_info([TOP_K_ALL] * 3, [1.0] * 3), False, False)
    picks_of(decode_tool, recorder, backend, info, make_logits("flat", (3 * NODES, VOCAB), 3).float())
    assert [name for name, _ in recorder.calls] == ["dense"]


@pytest.mark.parametrize(("top_ks", "need_top_k", "need_top_p", "path"), ONE_CUT)
def test_on_pytorch_one_cut_takes_rc5s_path(decode_tool: ModuleType, recorder: Recorder, top_ks: list[int],
                                            need_top_k: bool, need_top_p: bool, path: str,
                                            make_logits: Callable[..., torch.Tensor]) -> None:
    info = flags(batch_info(top_ks, [0.9] * 3 if need_top_p else [1.0] * 3), need_top_k, need_top_p)
    picks_of(decode_tool, recorder, "pytorch", info, make_logits("flat", (3 * NODES, VOCAB), 3).float())
    assert [name for name, _ in recorder.calls] == (["dense"] if path == "dense" else [])
    if path == "sparse":
        assert recorder.sampled_from[0].shape == (3 * NODES, 20)  # the top 20 only, no dense block


@pytest.mark.parametrize(("top_ks", "need_top_k", "need_top_p", "path"),
                         [*ONE_CUT, ([20, 5, TOP_K_ALL], True, True, "both")])
def test_on_flashinfer_every_cut_goes_to_plain_decodings_joint_kernel(
        decode_tool: ModuleType, recorder: Recorder, top_ks: list[int], need_top_k: bool, need_top_p: bool,
        path: str, make_logits: Callable[..., torch.Tensor]) -> None:
    """sampler.py's flashinfer branch keeps tokens tied at a cut together, even with one cut, so
    the tree takes the same kernel wherever a cut applies."""
    info = flags(batch_info(top_ks, [0.95, 0.5, 0.8] if need_top_p else [1.0] * 3), need_top_k, need_top_p)
    logits = make_logits("bf16", (3 * NODES, VOCAB), 11).float()
    picks_of(decode_tool, recorder, "flashinfer", info, logits)
    [(name, (probs, node_top_ks, node_top_ps, order))] = recorder.calls
    want_probs, _, want_top_ps = repeated(info, logits)
    assert name == "joint" and order == "joint"
    assert torch.allclose(probs, want_probs, atol=1e-7)  # softmax(logits / T) at every node, as plain decoding
    assert torch.equal(node_top_ks, torch.repeat_interleave(info.top_ks, NODES)) and torch.equal(node_top_ps, want_top_ps)
    assert recorder.sampled_from == []


def test_on_flashinfer_a_min_p_request_sends_the_batch_to_plains_sequential_rule(
        decode_tool: ModuleType, recorder: Recorder, make_logits: Callable[..., torch.Tensor]) -> None:
    """A greedy request may carry min_p (it is exact there); plain decoding then renormalises by
    top-k, then top-p, then samples by min_p, for every request of the batch."""
    info = flags(batch_info([1, 5, 12], [1.0, 0.9, 0.5]), True, True, need_min_p=True)
    info.min_ps = torch.tensor([0.2, 0.0, 0.0])
    logits = make_logits("flat", (3 * NODES, VOCAB), 5).float()
    picks_of(decode_tool, recorder, "flashinfer", info, logits)
    assert [name for name, _ in recorder.calls] == ["top_k_renorm", "top_p_renorm", "min_p"]
    assert torch.equal(recorder.calls[2][1][1], torch.repeat_interleave(info.min_ps, NODES))


@pytest.mark.parametrize("chunk", [1 << 26, VOCAB * NODES // 2], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("top_ks", [[8, 3, 20], [TOP_K_ALL, 6, 30]], ids=["below-V", "one-unset"])
def test_on_pytorch_both_cuts_sample_every_node_as_plain_decoding(
        decode_tool: ModuleType, recorder: Recorder, plain_distribution: Callable[..., torch.Tensor],
        make_logits: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch, chunk: int,
        top_ks: list[int]) -> None:
    sampling = decode_tool.load_overlay_module(RC6, SAMPLING)
    monkeypatch.setattr(sampling, "JOINT_CHUNK_ELEMENTS", chunk)
    info = flags(batch_info(top_ks, [0.5, 0.9, 0.8]), True, True)
    logits = make_logits("flat", (3 * NODES, VOCAB), 17).float()  # no exact ties: token identity is compared
    torch.manual_seed(0)
    picks = picks_of(decode_tool, recorder, "pytorch", info, logits)
    k = VOCAB if TOP_K_ALL in top_ks else 20
    rows = [block.shape[0] for block in recorder.sampled_from]
    per_chunk = chunk // k
    assert sum(rows) == 3 * NODES and len(rows) == -(-3 * NODES // per_chunk)  # chunks of rows, not requests
    assert recorder.calls == []
    # The probabilities each node was drawn from, mapped back to token ids, are plain decoding's.
    order = torch.topk(logits / torch.repeat_interleave(info.temperatures, NODES, dim=0), k, dim=-1).indices
    drawn = torch.zeros_like(logits).scatter(1, order, torch.cat(recorder.sampled_from))
    assert torch.allclose(drawn, plain_distribution(*repeated(info, logits)), atol=1e-6)
    assert bool((drawn.gather(1, picks) > 0).all())  # every pick is a kept token
