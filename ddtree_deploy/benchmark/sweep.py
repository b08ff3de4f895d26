"""The sweep: restart the host's server per variant (plain, DFLASH, DDTREE at each budget) and measure it.

Every restart goes through `service.restart` (fail fast on exit, a fatal log line or a foreign port
owner), so a budget the server refuses ends the sweep with the log's tail, and the playbook's
`on_failure` puts the host back. The plain server runs first and its greedy answers are the
reference (recorded in one more, untimed pass with the top five log-probs per token): each
speculative variant's greedy answers, at batch 1 and at the user's batch, must equal them token for
token (lossless) or part from them only where plain's own best tokens were near-tied (a bf16
split, divergence.py; each is listed), or the sweep stops there. Requests run through the host
helper on the host's loopback; their time is measured there, so SSH latency never counts.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ddtree_deploy import divergence, service
from ddtree_deploy.benchmark import measure
from ddtree_deploy.benchmark.results import (
    BenchResults,
    Lossless,
    Mode,
    NearTie,
    RequestStats,
    RunResult,
    TreeStats,
    VariantResult,
    variant_name,
)
from ddtree_deploy.divergence import TopLogprobs
from ddtree_deploy.errors import BenchError, DeployError
from ddtree_deploy.probing import http_request
from ddtree_deploy.transport import Transport

DEFAULT_BUDGETS = [16, 32, 64, 128, 256, 512, 1024]
#: Pinned prompts: prose, code and lists, as in the lossless probes (what a greedy decode repeats well
#: and what it does not).
DEFAULT_PROMPTS: list[str | list[int]] = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "the draft block is verified by the target",
    "import os\nimport sys\n\n\ndef main():",
    "one two three four five six seven eight nine ten",
    "class Stack:\n    def __init__(self):",
    "kernel graph memory decode prefill verify accept",
]
SPEC_PREFIX = "--speculative-"
DDTREE_FLAGS = ("--speculative-algorithm", "--speculative-ddtree-budget", "--speculative-ddtree-debug")

Progress = Callable[[str], None]
#: one greedy answer: its output ids, and plain's top log-probs where the pass asked for them
Answer = tuple[list[int], TopLogprobs | None]
#: greedy answers by prompt index
Answers = dict[int, Answer]


class BenchArgs(BaseModel):
    """The `bench` step's arguments (the command fills them from its options)."""

    model_config = ConfigDict(extra="forbid")

    budgets: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: list(DEFAULT_BUDGETS), min_length=1)
    prompts: list[str | list[int]] = Field(default_factory=lambda: list(DEFAULT_PROMPTS), min_length=1)
    max_new_tokens: int = Field(default=128, ge=1)
    batch: int = Field(default=4, ge=1, description="the batch size measured besides 1")
    temperature: float = Field(default=0.7, gt=0, description="of the sampled runs")
    seeds: list[int] = Field(default_factory=lambda: [0, 1], description="one sampled pass per seed; [] for none")
    dflash: bool = Field(default=True, description="measure DFLASH's chain as a baseline")
    tree_stats: bool = Field(default=True, description="one more start per budget with --speculative-ddtree-debug")
    request_timeout_s: float = Field(default=600.0, gt=0)
    keep_json: str | None = Field(default=None, description="a file rewritten after every variant with the results so "
                                                           "far, so a bench killed mid-way keeps what it measured")
    keep_going: bool = Field(default=False, description="a variant that is not lossless is recorded and the sweep goes "
                                                        "on; the bench still fails, after the last variant")
    tie_tolerance: float = Field(default=divergence.DEFAULT_TIE_TOLERANCE, ge=0,
                                 description="nats: a split at a near-tie of plain's this close is reported, "
                                             "not failed; 0: only identical answers pass")

    @field_validator("prompts")
    @classmethod
    def _one_kind(cls, prompts: list[str | list[int]]) -> list[str | list[int]]:
        if len({isinstance(p, str) for p in prompts}) > 1:
            raise ValueError("prompts are all text or all token-id lists, not both")
        if any(not p for p in prompts):
            raise ValueError("a prompt is empty")
        return prompts


@dataclass(frozen=True)
class Variant:
    algorithm: str | None  # None: plain decoding
    budget: int | None = None
    debug: bool = False

    @property
    def name(self) -> str:
        return variant_name(self.algorithm, self.budget)

    def server_args(self, found: list[str]) -> list[str]:
        """The server args the host ran with, made into this variant's (other flags kept as they were)."""
        if self.algorithm is None:
            return without(found, lambda flag: flag.startswith(SPEC_PREFIX))
        if self.algorithm == "DFLASH":
            kept = without(found, lambda flag: flag == "--speculative-algorithm" or flag.startswith("--speculative-ddtree-"))
            return [*kept, "--speculative-algorithm", "DFLASH"]
        kept = without(found, lambda flag: flag in DDTREE_FLAGS)
        return [*kept, "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(self.budget),
                *(["--speculative-ddtree-debug"] if self.debug else [])]


def without(argv: list[str], drop: Callable[[str], bool]) -> list[str]:
    """`argv` less every `--flag [values...]` (or `--flag=value`) whose flag `drop` picks."""
    out: list[str] = []
    dropping = False
    for token in argv:
        if token.startswith("--"):
            dropping = drop(token.partition("=")[0])
        if not dropping:
            out.append(token)
    return out


def variants(args: BenchArgs) -> list[Variant]:
    return [Variant(None), *([Variant("DFLASH")] if args.dflash else []), *(Variant("DDTREE", b) for b in args.budgets)]


class Sweep:
    """One bench on one host: `run()` returns the results (partial ones ride on any error's details)."""

    def __init__(self, transport: Transport, args: BenchArgs, found_args: list[str], progress: Progress) -> None:
        self.t, self.args, self.found = transport, args, found_args
        self.progress = progress
        self.started = time.monotonic()
        self.reference: dict[tuple[int, int], Answer] = {}  # by (batch, prompt index)
        self.results = BenchResults(source="ddtree-deploy bench", host=transport.host.name,
                                    created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    max_new_tokens=args.max_new_tokens, batch=args.batch, prompts=list(args.prompts))

    def run(self) -> BenchResults:
        todo = variants(self.args)
        try:
            for index, variant in enumerate(todo, 1):
                self._tell(f"{variant.name} ({index}/{len(todo)})")
                self.results.variants.append(self._measure(variant))
                self._keep()
                self._stop_if_lossy(last=index == len(todo))
        except DeployError as exc:
            exc.details.setdefault("bench", self.results.model_dump(mode="json", by_alias=True))
            raise
        return self.results

    def _stop_if_lossy(self, *, last: bool) -> None:
        """Fail at the first variant that is not lossless, or with --keep-going after the last one."""
        lossy = [v for v in self.results.variants if v.lossless is not None and v.lossless.mismatch]
        if not lossy or (self.args.keep_going and not last):
            return
        reasons = "; ".join(f"{v.variant} is not lossless: {v.lossless.mismatch}" for v in lossy if v.lossless)
        raise BenchError(reasons, host=self.t.host.name, code="bench_lossy",
                         hint="speculative decoding must answer as the plain server did; see the overlay's "
                              "lossless probes")

    def _keep(self) -> None:
        """Rewrite `keep_json` (a temporary file renamed over it: a kill never leaves half a file)."""
        if self.args.keep_json is None:
            return
        path = Path(self.args.keep_json)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(self.results.model_dump_json(indent=1, by_alias=True) + "\n")
        partial.replace(path)

    def _tell(self, what: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        self.progress(f"bench {what}, {elapsed // 60}m{elapsed % 60:02d}s elapsed")

    # ------------------------------------------------------------------ one variant

    def _measure(self, variant: Variant) -> VariantResult:
        server_args = variant.server_args(self.found)
        ready = self._restart(server_args)
        info = self._server_info(variant)
        result = VariantResult(variant=variant.name, algorithm=variant.algorithm, budget=variant.budget,
                               server_args=server_args, ready_s=ready.waited_s)
        self._warm_up()
        greedy = [self._pass(variant, "greedy", batch) for batch in self._batches()]
        result.runs += [run for run, _ in greedy]
        result.runs += [self._sampled(variant, batch) for batch in self._batches()] if self.args.seeds else []
        if variant.algorithm is None:
            self._record_reference(variant, info)
        else:
            result.lossless = self._lossless(greedy)
        if variant.algorithm == "DDTREE" and self.args.tree_stats:
            result.tree = self._tree_pass(Variant("DDTREE", variant.budget, debug=True))
        return result

    def _batches(self) -> list[int]:
        return [1, self.args.batch] if self.args.batch > 1 else [1]

    def _restart(self, server_args: list[str]) -> service.ServiceReport:
        report = service.restart(self.t, server_args)
        report.raise_for_failure()
        return report

    def _server_info(self, variant: Variant) -> dict[str, Any]:
        answer = http_request(self.t, "/server_info")
        try:
            info = json.loads(answer.body)
        except ValueError:
            return {}
        if not isinstance(info, dict):
            return {}
        if variant.algorithm and self.results.block_size is None:
            block = info.get("speculative_dflash_block_size") if variant.algorithm == "DDTREE" else None
            block = block or (info.get("speculative_num_draft_tokens") if variant.algorithm == "DFLASH" else None)
            self.results.block_size = int(block) if block else None
        return info

    def _warm_up(self) -> None:
        """One short request first: a real server compiles and captures on its first decode."""
        self._generate([self.args.prompts[0]], {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
                       _rids("warmup", 1))

    # ------------------------------------------------------------------ passes

    def _pass(self, variant: Variant, mode: Mode, batch: int, seed: int | None = None, *, logprobs: bool = False
              ) -> tuple[RunResult, Answers]:
        """Every prompt once (in groups of `batch`); returns the run and the answers by prompt index."""
        params: dict[str, Any] = {"temperature": 0 if mode == "greedy" else self.args.temperature,
                                  "max_new_tokens": self.args.max_new_tokens, "ignore_eos": True}
        if seed is not None:
            params["sampling_seed"] = seed
        prompts = list(enumerate(self.args.prompts))
        while len(prompts) % batch:  # fill the last group: every call carries `batch` requests
            prompts.append(prompts[len(prompts) % len(self.args.prompts)])
        batches, outputs = [], {}
        for start in range(0, len(prompts), batch):
            group = prompts[start:start + batch]
            elapsed, items = self._generate([p for _, p in group], params, _rids(f"{variant.name}-{mode}", batch),
                                            divergence.LOGPROB_REQUEST if logprobs else {})
            stats = [measure.request_stats(item, i, seed=seed, elapsed_s=elapsed if batch == 1 else None)
                     for (i, _), item in zip(group, items, strict=True)]
            outputs.update({i: (list(item.get("output_ids") or []),
                                divergence.top_logprobs(item.get("meta_info") or {}) if logprobs else None)
                            for (i, _), item in zip(group, items, strict=True)})
            batches.append((elapsed, stats))
        run = measure.run_result(mode, batch, float(params["temperature"]), batches, self.results.block_size)
        return run, outputs

    def _sampled(self, variant: Variant, batch: int) -> RunResult:
        runs = [self._pass(variant, "sampled", batch, seed)[0] for seed in self.args.seeds]
        batches: list[tuple[float, list[RequestStats]]] = [(r.elapsed_s, r.requests) for r in runs]
        merged = measure.run_result("sampled", batch, self.args.temperature, batches, self.results.block_size)
        # the round time is each pass's own mean; merging (elapsed, requests) pairs would weigh by pass
        times = [r.round_time_ms for r in runs if r.round_time_ms is not None]
        return merged.model_copy(update={"round_time_ms": sum(times) / len(times) if times else None})

    def _generate(self, prompts: list[str | list[int]], params: dict[str, Any], rids: list[str],
                  extra: dict[str, Any] | None = None) -> tuple[float, list[dict[str, Any]]]:
        key = "text" if isinstance(prompts[0], str) else "input_ids"
        one = len(prompts) == 1
        body = {key: prompts[0] if one else prompts, "sampling_params": params, "rid": rids[0] if one else rids,
                **(extra or {})}
        answer = http_request(self.t, "/generate", method="POST", body=body, timeout=self.args.request_timeout_s)
        try:
            value = json.loads(answer.body) if answer.status == 200 else None
        except ValueError:
            value = None
        items = [value] if isinstance(value, dict) else value
        if not isinstance(items, list) or len(items) != len(prompts) or not all(isinstance(i, dict) for i in items):
            raise BenchError(f"/generate answered {answer.status or answer.error}: {answer.body[:200]!r}",
                             host=self.t.host.name, code="bench_generate_failed",
                             hint=f"see `ddtree-deploy logs --host {self.t.host.name}`")
        return answer.elapsed_s, items

    # ------------------------------------------------------------------ reference, lossless, tree

    def _record_reference(self, plain: Variant, info: dict[str, Any]) -> None:
        """Plain's greedy answers with their top log-probs, from one more pass per batch (untimed: asking
        for log-probs costs time, and the timed passes of every variant must ask the same)."""
        for batch in self._batches():
            _, answers = self._pass(plain, "greedy", batch, logprobs=True)
            self.reference.update({(batch, i): answer for i, answer in answers.items()})
        self.results.sglang = info.get("version")
        self.results.model = info.get("model_path")

    def _lossless(self, greedy: list[tuple[RunResult, Answers]]) -> Lossless:
        result = Lossless(compared=0, identical=0, tie_tolerance=self.args.tie_tolerance)
        for run, answers in greedy:
            for i, (ids, _) in sorted(answers.items()):
                if (run.batch, i) not in self.reference:
                    continue
                expected, top = self.reference[(run.batch, i)]
                split = divergence.compare(expected, ids, top, self.args.tie_tolerance)
                result.compared += 1
                if split.kind == "identical":
                    result.identical += 1
                elif split.kind == "near_tie":
                    result.near_ties.append(NearTie(prompt=i, batch=run.batch, token=split.index or 0,
                                                    gap=split.gap or 0.0))
                elif result.mismatch is None:
                    result.mismatch = f"prompt {i} at batch {run.batch} differs from the plain server at {split.describe()}"
        return result

    def _tree_pass(self, variant: Variant) -> TreeStats | None:
        """Restart with the overlay's debug lines on, decode the prompts greedily, read the lines back."""
        self._tell(f"{variant.name} tree statistics (--speculative-ddtree-debug)")
        ready = self._restart(variant.server_args(self.found))
        params = {"temperature": 0, "max_new_tokens": self.args.max_new_tokens, "ignore_eos": True}
        rids = _rids(f"{variant.name}-tree", len(self.args.prompts))
        for prompt, rid in zip(self.args.prompts, rids, strict=True):
            self._generate([prompt], params, [rid])
        return measure.tree_stats(measure.debug_records(self._log_since(ready.log_offset), rids))

    def _log_since(self, offset: Any) -> str:
        chunks: list[str] = []
        while True:
            chunk = service.logs(self.t, offset=offset)
            if not chunk.text or chunk.offset == offset:
                return "".join(chunks)
            chunks.append(chunk.text)
            offset = chunk.offset


def _rids(tag: str, count: int) -> list[str]:
    """Request ids the bench can find again in the server's debug lines."""
    return [f"bench-{tag}-{uuid.uuid4().hex[:12]}" for _ in range(count)]
