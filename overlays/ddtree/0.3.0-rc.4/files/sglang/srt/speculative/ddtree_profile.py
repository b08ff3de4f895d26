"""Where a DDTREE decode round's time goes, stage by stage (``SGLANG_DDTREE_PROFILE=1``; off by default).

The worker marks the end of each stage of ``DDTreeWorkerV2._forward_tree_round``. A mark records a
CUDA event on the current stream and reads the host clock. A finished round's GPU times are read only
once its last event has completed (``Event.query``, never a wait), so profiling adds no host
synchronisation and leaves the overlap scheduler's timing as it is. Every ``every`` rounds one log line
``ddtree_profile {json}`` gives the mean GPU and host milliseconds of each stage and of the round. On
a tiny, host-bound model the host times are the ones that explain a slow round; on a large model the
GPU times.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from typing import Deque, Dict, List, Tuple

import torch

logger = logging.getLogger(__name__)

#: a round's stages in order, each ending at the worker's mark of that name
STAGES = (
    "draft",  # the drafter's forward over [bonus, MASK x (S-1)]
    "tree_build",  # top-K, best-first trees and the verify inputs (one graph replay)
    "verify_inputs",  # the tree mask and the target verify's forward batch
    "target_verify",  # the target forward over [root] + nodes
    "picks",  # logit adjustments and the target's token at every node
    "commit",  # the walk, the commit plan, the KV moves (and a hybrid's recurrent state)
    "draft_kv",  # the drafter's KV for the committed tokens
)

Mark = Tuple[str, torch.cuda.Event, float]


class DDTreeRoundProfile:
    """Per-stage GPU and host times of the rounds, logged as running means; every call is a no-op
    unless ``enabled``, so the worker marks its stages unconditionally."""

    def __init__(self, device: torch.device, enabled: bool, every: int = 64):
        self.device = device
        self.enabled = enabled
        self.every = every
        self._marks: List[Mark] = []
        self._pending: Deque[Tuple[int, List[Mark]]] = deque()
        self._gpu_ms: Dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._host_ms: Dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._rounds = 0
        self._requests = 0

    @classmethod
    def from_env(cls, device: torch.device) -> "DDTreeRoundProfile":
        enabled = os.environ.get("SGLANG_DDTREE_PROFILE", "0") == "1"
        every = max(1, int(os.environ.get("SGLANG_DDTREE_PROFILE_EVERY", "64")))
        if enabled:
            logger.info("DDTREE round profile on: one ddtree_profile line every %d rounds.", every)
        return cls(device, enabled, every)

    def start(self) -> None:
        if not self.enabled:
            return
        self._drain()
        self._marks = []
        self.mark("start")

    def mark(self, stage: str) -> None:
        if not self.enabled:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._marks.append((stage, event, time.perf_counter()))

    def end(self, bs: int) -> None:
        if not self.enabled:
            return
        self._pending.append((bs, self._marks))
        self._marks = []
        while len(self._pending) > 8:  # rounds whose events never completed are dropped
            self._pending.popleft()

    def _drain(self) -> None:
        while self._pending and self._pending[0][1][-1][1].query():
            bs, marks = self._pending.popleft()
            for (_, before, host_before), (stage, after, host_after) in zip(marks, marks[1:], strict=False):
                if stage in self._gpu_ms:
                    self._gpu_ms[stage] += before.elapsed_time(after)
                    self._host_ms[stage] += 1000.0 * (host_after - host_before)
            self._rounds += 1
            self._requests += bs
            if self._rounds == self.every:
                self._log()

    def _log(self) -> None:
        n = self._rounds
        record = {
            "rounds": n,
            "bs_mean": round(self._requests / n, 2),
            "gpu_ms": {s: round(v / n, 4) for s, v in self._gpu_ms.items()},
            "host_ms": {s: round(v / n, 4) for s, v in self._host_ms.items()},
            "gpu_round_ms": round(sum(self._gpu_ms.values()) / n, 4),
            "host_round_ms": round(sum(self._host_ms.values()) / n, 4),
        }
        logger.info("ddtree_profile %s", json.dumps(record, sort_keys=True))
        self._gpu_ms = dict.fromkeys(STAGES, 0.0)
        self._host_ms = dict.fromkeys(STAGES, 0.0)
        self._rounds = self._requests = 0
