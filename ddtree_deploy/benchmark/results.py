"""The bench's results: one JSON document (schema `ddtree-deploy.bench/1`) and its acceptance arithmetic.

Acceptance length tau is the number of tokens one speculative round commits: the accepted draft
tokens plus the bonus token the target adds, so 1 <= tau <= S (S = the draft block size; a DDTree
of depth up to S - 1 commits at most S). The histogram is P(tau = b) for b = 1..S over all rounds,
and the mean is z-lab's "Average Acceptance length": the mean over requests of each request's mean
tau (dflash/benchmark.py, `_print_decode_summary`). `per_round` is the pooled mean (committed tokens
over rounds), which weighs long requests more. docs/bench.md documents every field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA = "ddtree-deploy.bench/1"
Mode = Literal["greedy", "sampled"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RequestStats(_Model):
    """One request's decode: its rounds and the histogram of their acceptance lengths."""

    prompt: int = Field(description="index into BenchResults.prompts")
    seed: int | None = Field(default=None, description="sampling seed (sampled runs)")
    completion_tokens: int
    rounds: int = Field(default=0, description="verify rounds (SGLang's spec_verify_ct); 0 for plain decoding")
    accept_counts: list[int] = Field(default_factory=list,
                                     description="accept_counts[b-1]: rounds that committed b tokens")
    accepted: int | None = Field(default=None, description="draft tokens accepted over all rounds, when the "
                                                           "server gives no histogram (spec_num_correct_drafts)")
    elapsed_s: float | None = Field(default=None, description="the request's wall time on the host (batch 1)")

    @property
    def mean_accept(self) -> float | None:
        total = sum(self.accept_counts)
        if total:
            return sum((b + 1) * c for b, c in enumerate(self.accept_counts)) / total
        return 1 + self.accepted / self.rounds if self.accepted is not None and self.rounds else None


class Acceptance(_Model):
    mean: float = Field(description="mean over requests of each request's mean tau (z-lab's average)")
    per_round: float = Field(description="pooled: committed tokens over rounds")
    histogram: list[float] = Field(description="histogram[b-1] = P(tau = b), b = 1..S, over all rounds")
    rounds: int


class RunResult(_Model):
    """One pass over the prompts at one batch size and sampling mode."""

    mode: Mode
    batch: int
    temperature: float
    requests: list[RequestStats]
    completion_tokens: int
    elapsed_s: float = Field(description="wall time of the requests on the host, summed over batches")
    tokens_per_s: float
    round_time_ms: float | None = Field(default=None,
                                        description="elapsed time over the rounds of the batch's longest request")
    acceptance: Acceptance | None = Field(default=None, description="None for plain decoding")


class TreeStats(_Model):
    """From the overlay's `ddtree_debug` lines (one per request and round, --speculative-ddtree-debug)."""

    rounds: int
    nodes_mean: float = Field(description="mean tree size (nodes, root excluded)")
    depth_mean: float
    depth_max: int
    top1_agreement: list[float | None] = Field(
        description="per depth d = 1..S-1: share of rounds where the draft's top-1 equals the target's token "
                    "(None where the target's token was never known)")
    accept_mean: float = Field(description="mean tau of the logged rounds (must equal the greedy run's per_round)")


class NearTie(_Model):
    """A greedy answer that parts from the plain server's at a near-tie of plain's own best tokens."""

    prompt: int = Field(description="index into `prompts`")
    batch: int
    token: int = Field(description="where the answers part (tokens after it are not compared)")
    gap: float = Field(description="nats: plain's log-prob of its token minus that of the token taken")


class Lossless(_Model):
    compared: int
    identical: int
    tie_tolerance: float = Field(default=0.0, description="nats: the largest gap a split may have to be a near-tie")
    near_ties: list[NearTie] = Field(default_factory=list, description="splits explained by a near-tie")
    mismatch: str | None = Field(default=None, description="the first request that differs otherwise, in words")


class VariantResult(_Model):
    """One server configuration: plain decoding, DFLASH's chain, or DDTREE at one budget."""

    variant: str = Field(description="'plain', 'dflash' or 'ddtree@B'")
    algorithm: str | None = None
    budget: int | None = None
    server_args: list[str] = Field(default_factory=list)
    ready_s: float | None = Field(default=None, description="restart to ready")
    runs: list[RunResult] = Field(default_factory=list)
    tree: TreeStats | None = None
    lossless: Lossless | None = None

    def run(self, mode: Mode = "greedy", batch: int = 1) -> RunResult | None:
        return next((r for r in self.runs if r.mode == mode and r.batch == batch), None)

    @property
    def acceptance(self) -> Acceptance | None:
        """The headline acceptance: greedy at batch 1 (else the first run that has one)."""
        first = self.run("greedy", 1)
        if first is not None and first.acceptance is not None:
            return first.acceptance
        return next((r.acceptance for r in self.runs if r.acceptance is not None), None)


class BenchResults(_Model):
    """The whole bench (or an offline decode written in the same shape)."""

    schema_: str = Field(default=SCHEMA, alias="schema")
    source: str = Field(description="'ddtree-deploy bench', 'ddtree_cpu_decode' or 'z-lab benchmark.py'")
    host: str | None = None
    created_at: str | None = None
    sglang: str | None = None
    overlay: str | None = None
    model: str | None = None
    block_size: int | None = Field(default=None, description="S: the draft block (tau <= S)")
    max_new_tokens: int | None = None
    batch: int | None = Field(default=None, description="the batch size besides 1")
    prompts: list[str | list[int]] = Field(default_factory=list, description="text, or token ids")
    variants: list[VariantResult] = Field(default_factory=list)
    note: str = ""

    def variant(self, name: str) -> VariantResult | None:
        return next((v for v in self.variants if v.variant == name), None)


def acceptance_of(requests: list[RequestStats], size: int | None = None) -> Acceptance | None:
    """Pool requests' rounds into an `Acceptance` (histogram of `size` bins, else as long as the data)."""
    means = [m for m in (r.mean_accept for r in requests) if m is not None]
    if not means:
        return None
    width = max(size or 0, *(len(r.accept_counts) for r in requests))
    pooled = [sum(r.accept_counts[b] for r in requests if b < len(r.accept_counts)) for b in range(width)]
    rounds = sum(r.rounds for r in requests)
    committed = sum(r.mean_accept * r.rounds for r in requests if r.mean_accept is not None)
    counted = sum(pooled)  # rounds of the requests that came with a histogram
    return Acceptance(mean=sum(means) / len(means), per_round=committed / rounds if rounds else means[0],
                      histogram=[c / counted for c in pooled] if counted else [], rounds=rounds)


def total_variation(p: list[float], q: list[float]) -> float:
    """Half the L1 distance between two histograms over b = 1.. (the shorter is padded with zeros)."""
    width = max(len(p), len(q))
    return 0.5 * sum(abs((p[i] if i < len(p) else 0.0) - (q[i] if i < len(q) else 0.0)) for i in range(width))


def variant_name(algorithm: str | None, budget: int | None) -> str:
    if not algorithm:
        return "plain"
    return f"ddtree@{budget}" if algorithm.upper() == "DDTREE" else algorithm.lower()
