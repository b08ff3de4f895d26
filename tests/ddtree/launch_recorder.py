"""What the Triton top-K's and tree build's launches carry, recorded in ``test_tree_build_triton``'s interpreter
child: the interpreter takes a launch's options and runs no PTX, so each launch records its options, then runs (without
those the interpreter cannot run)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from unittest import mock

import torch

TOP_K_LAUNCHES = {"lse": "_ddtree_lse_parts_kernel", "log_probs": "_ddtree_log_probs_kernel",
                  "count": "_ddtree_radix_count_kernel", "split": "_ddtree_split_ids_kernel",
                  "order": "_ddtree_top_k_order_kernel"}
BUILD_LAUNCHES = {"pop": "_ddtree_build_kernel", "visibility": "_ddtree_visibility_kernel"}


@contextlib.contextmanager
def recorded(module: ModuleType, kernels: dict[str, str], options: tuple[str, ...], *,
              strip: bool = False) -> Iterator[dict[str, dict[str, Any]]]:
    """Each launch of ``module``'s ``kernels`` (label: attribute) records which of ``options`` it carries, under
    its label (a count pass's with its PASS); with ``strip``, it then runs without them."""
    seen: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        for label, attribute in kernels.items():
            kernel = getattr(module, attribute)

            def run(*args: Any, label: str = label, real: Callable[..., Any] = kernel.run, **kwargs: Any) -> Any:
                seen[label + (f" {kwargs['PASS']}" if "PASS" in kwargs else "")] = {
                    option: kwargs[option] for option in options if option in kwargs}
                return real(*args, **{key: value for key, value in kwargs.items() if not (strip and key in options)})

            stack.enter_context(mock.patch.object(kernel, "run", run))
        yield seen


def launch_caps(top_k_kernel: ModuleType, logits: torch.Tensor, k: int) -> dict[object, dict[str, Any]]:
    """The ``maxnreg`` each of the top-K's launches carries, by chunk, and on ROCm."""
    caps: dict[object, dict[str, Any]] = {}
    for label, chunk, hip in ((2048, 2048, None), (4096, 4096, None), ("rocm", 2048, "6.2")):
        with (recorded(top_k_kernel, TOP_K_LAUNCHES, ("maxnreg",)) as seen,
              mock.patch.object(torch.version, "hip", hip),
              mock.patch.object(top_k_kernel, "_ddtree_vocab_chunk", lambda *_, chunk=chunk: chunk)):
            top_k_kernel.ddtree_top_k_triton(draft_logits=logits, k=k)
        caps[label] = seen
    return caps


def dependent_launches(launch: ModuleType, top_k_kernel: ModuleType, build_kernel: ModuleType, logits: torch.Tensor,
                       k: int) -> dict[str, Any]:
    """rc.36 on: ``ddtree_dependent_launch``'s answers (SGLang's ``is_arch_support_pdl`` stood in for; this child
    runs under the interpreter, so each answer but the last is asked with it off), and the options each launch of a
    top-K, a build and the log-probs alone carries where it answers yes."""
    # rc.36 imported SGLang's check when it loaded, rc.37 imports it from the stand-in module at each call.
    check_home = launch if hasattr(launch, "is_arch_support_pdl") else sys.modules["sglang.kernels.jit.utils"]
    answers = {}
    for label, device, capable, interpreter in (("cuda, sm_90 on", "cuda", True, "0"), ("cuda, older", "cuda", False, "0"),
                                                ("cpu", "cpu", True, "0"), ("cuda, interpreter", "cuda", True, "1")):
        with (mock.patch.object(check_home, "is_arch_support_pdl", lambda capable=capable: capable),
              mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpreter})):
            answers[label] = launch.ddtree_dependent_launch(torch.device(device))
    options = ("USE_GDC", "launch_pdl")
    capable = answers["cuda, sm_90 on"]  # what a Hopper's tensors get (these are on the CPU)
    alone = {f"{label} alone": TOP_K_LAUNCHES[label] for label in ("lse", "log_probs")}
    with (mock.patch.object(top_k_kernel, "ddtree_dependent_launch", lambda device: capable),
          mock.patch.object(build_kernel, "ddtree_dependent_launch", lambda device: capable)):
        with (recorded(top_k_kernel, TOP_K_LAUNCHES, options, strip=True) as top_k_seen,
              recorded(build_kernel, BUILD_LAUNCHES, options, strip=True) as build_seen):
            log_probs, tokens = top_k_kernel.ddtree_top_k_triton(draft_logits=logits, k=k)
            build_kernel.build_ddtree_trees_triton(log_probs=log_probs, top_tokens=tokens, budget=k)
        with recorded(top_k_kernel, alone, options, strip=True) as alone_seen:
            top_k_kernel.ddtree_log_probs_triton(logits)
    return {"dependent_options": answers, "dependent_launches": {**top_k_seen, **build_seen, **alone_seen}}
