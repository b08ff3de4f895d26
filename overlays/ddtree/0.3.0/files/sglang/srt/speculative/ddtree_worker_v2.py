"""DDTREE speculative worker (spec-v2): the DFlash worker with a draft-tree decode round."""

from __future__ import annotations

import dataclasses
import json
import logging
from copy import deepcopy
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from sglang.kernels.ops.speculative.ddtree import fill_ddtree_verify_mask
from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.ddtree_hybrid import DDTreeStateCheck, ddtree_link_parents
from sglang.srt.speculative.ddtree_info import DDTreeVerifyInput
from sglang.srt.speculative.ddtree_utils import (
    DDTreeBatch,
    DDTreeCommit,
    build_ddtree_batch,
    ddtree_commit_plan,
    ddtree_verify_inputs,
    draft_top1_agreement,
    tree_links,
)
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import (
    apply_dflash_verify_logits_adjustments,
    build_dflash_verify_target_probs,
)
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import (
    commit_mamba_states_after_verify,
    fast_sample,
    prepare_mamba_track_for_verify,
)

if TYPE_CHECKING:
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DDTreeRoundTensors:
    """The tree of a round and its verify inputs (see ``ddtree_verify_inputs``)."""

    tree: DDTreeBatch
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    # First-child / next-sibling links, for a hybrid target's tree kernels (else None).
    # Shape: [bs, budget + 1].
    next_token: Optional[torch.Tensor] = None
    next_sibling: Optional[torch.Tensor] = None


def ddtree_prepare_round(
    draft_logits: torch.Tensor,
    budget: int,
    bonus_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    with_links: bool = False,
) -> DDTreeRoundTensors:
    """Build the trees and the verify inputs: the round's device work before the verify."""
    tree = build_ddtree_batch(draft_logits, budget)
    ids, positions, slots = ddtree_verify_inputs(
        tree, bonus_tokens, prefix_lens, req_pool_indices, req_to_token
    )
    round_tensors = DDTreeRoundTensors(tree=tree, ids=ids, positions=positions, slots=slots)
    if with_links:
        _, round_tensors.next_token, round_tensors.next_sibling = tree_links(tree)
    return round_tensors


def _rows(value, bs: int):
    """The first ``bs`` rows of every tensor in a (nested dataclass of) tensors."""
    if isinstance(value, torch.Tensor):
        return value[:bs]
    return dataclasses.replace(
        value,
        **{
            f.name: _rows(getattr(value, f.name), bs)
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), (torch.Tensor, DDTreeBatch))
        },
    )


class DDTreeRoundGraphs:
    """CUDA graphs of a round's two tensor programs, one pair per batch size, so their
    few hundred small kernels replay as two launches: ``prepare`` (tree build and verify
    inputs, before the target verify) and ``commit`` (the walk and the commit plan,
    after it). A batch is padded up to the next captured size; larger batches run
    eagerly. Rows past the batch hold stale values that nothing reads.

    Outputs live in the graphs' static memory and are overwritten by the next round, so
    the worker clones whatever leaves the round (tokens and lengths the scheduler reads).
    """

    def __init__(self, *, budget: int, depth: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, req_to_token: torch.Tensor, with_links: bool):
        self.budget = budget
        self.with_links = with_links
        self.depth = depth
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.device = device
        self.req_to_token = req_to_token
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, Dict[str, torch.Tensor], DDTreeRoundTensors, DDTreeCommit]] = {}

    def _inputs(self, bs: int) -> Dict[str, torch.Tensor]:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        return {
            "logits": zeros(bs, self.depth, self.vocab_size, dtype=self.dtype),
            "bonus": zeros(bs),
            "prefix_lens": zeros(bs),
            "req_pool_indices": zeros(bs),
            "picks": zeros(bs, self.budget + 1),
        }

    def _prepare(self, x: Dict[str, torch.Tensor]) -> DDTreeRoundTensors:
        return ddtree_prepare_round(x["logits"], self.budget, x["bonus"], x["prefix_lens"],
                                    x["req_pool_indices"], self.req_to_token, self.with_links)

    def _commit(self, x: Dict[str, torch.Tensor], r: DDTreeRoundTensors) -> DDTreeCommit:
        return ddtree_commit_plan(r.tree, x["picks"], r.ids, r.slots, x["prefix_lens"])

    def capture(self, batch_sizes: List[int]) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in sorted(set(batch_sizes), reverse=True):
            x = self._inputs(bs)
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up allocator and kernels off the capture
                    self._commit(x, self._prepare(x))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            prepare, commit = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(prepare, pool=pool, capture_error_mode="thread_local"):
                round_tensors = self._prepare(x)
            with torch.cuda.graph(commit, pool=pool, capture_error_mode="thread_local"):
                plan = self._commit(x, round_tensors)
            self._graphs[bs] = (prepare, commit, x, round_tensors, plan)

    def _entry(self, bs: int):
        fits = [size for size in self._graphs if size >= bs]
        return self._graphs[min(fits)] if fits else None

    def prepare(self, draft_logits: torch.Tensor, bonus_tokens: torch.Tensor,
                prefix_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> DDTreeRoundTensors:
        bs = int(draft_logits.shape[0])
        entry = self._entry(bs)
        if entry is None:
            return ddtree_prepare_round(draft_logits, self.budget, bonus_tokens, prefix_lens,
                                        req_pool_indices, self.req_to_token, self.with_links)
        graph, _, x, round_tensors, _ = entry
        x["logits"][:bs].copy_(draft_logits)
        x["bonus"][:bs].copy_(bonus_tokens.view(-1))
        x["prefix_lens"][:bs].copy_(prefix_lens.view(-1))
        x["req_pool_indices"][:bs].copy_(req_pool_indices.view(-1))
        graph.replay()
        return _rows(round_tensors, bs)

    def commit(self, round_tensors: DDTreeRoundTensors, picks: torch.Tensor,
               prefix_lens: torch.Tensor) -> DDTreeCommit:
        bs = int(picks.shape[0])
        entry = self._entry(bs)
        if entry is None:
            return ddtree_commit_plan(round_tensors.tree, picks, round_tensors.ids,
                                      round_tensors.slots, prefix_lens)
        _, graph, x, _, plan = entry
        x["picks"][:bs].copy_(picks)
        graph.replay()
        plan = _rows(plan, bs)
        # new_seq_lens in prefix_lens' dtype, like the eager plan.
        return dataclasses.replace(plan, new_seq_lens=plan.new_seq_lens.to(prefix_lens.dtype))


class DDTreeWorkerV2(DFlashWorkerV2):
    """DDTREE worker: prefill, idle and the draft model are DFlash's; each decode
    round drafts once, builds a best-first tree of ``budget`` nodes on the GPU,
    verifies ``[root] + nodes`` in one target forward under the tree mask, walks
    the target's picks down the tree and commits the accepted path.

    The round has no host synchronisation (unless ``--speculative-ddtree-debug``)
    and the target verify replays a CUDA graph captured with the mask buffer.
    Rounds whose batch carries a grammar fall back to the DFlash chain round.

    On a hybrid GatedDeltaNet target the verify also carries the tree's links, so
    the GDN layers run their tree kernels (each node's conv window and recurrent
    state from its parent's, one snapshot per node), and every round commits each
    request's recurrent state at its last accepted node.
    """

    def __init__(
        self,
        server_args: ServerArgs,
        gpu_id: int,
        ps: ParallelState,
        nccl_port: int,
        target_worker: TpModelWorker,
    ):
        # The DFlash machinery (draft runner, block buffers, KV append) runs at the
        # draft block size; the verify width (1 + budget) stays in server_args.
        block_args = deepcopy(server_args)
        block_args.override(
            "ddtree.draft_block",
            speculative_num_draft_tokens=int(server_args.speculative_dflash_block_size),
        )
        super().__init__(block_args, gpu_id, ps, nccl_port, target_worker)
        self.budget = int(server_args.speculative_ddtree_budget)
        self.verify_width = self.budget + 1
        self.debug = bool(server_args.speculative_ddtree_debug)
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        self.max_context_len = int(self.model_runner.model_config.context_len)
        self.hybrid = mambaish_config(self.model_runner.model_config) is not None
        self._state_check: Optional[DDTreeStateCheck] = None  # debug, hybrid: set on first round
        self._verify_offsets = torch.arange(
            self.verify_width, dtype=torch.int64, device=self.device
        )
        self._mask_buf: Optional[torch.Tensor] = None
        self._round_graphs: Optional[DDTreeRoundGraphs] = None
        self._debug_draft_top1: Optional[torch.Tensor] = None  # set per round with --speculative-ddtree-debug
        self._warned_grammar = False
        if self.ps.tp_rank == 0:
            logger.info(
                "Initialized DDTREE worker: block_size=%d, budget=%d, verify_width=%d, debug=%s",
                self.block_size,
                self.budget,
                self.verify_width,
                self.debug,
            )

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        runner = self.model_runner.decode_cuda_graph_runner
        batch_sizes = list(getattr(runner, "capture_bs", None) or [])
        if not batch_sizes:
            return
        graphs = DDTreeRoundGraphs(
            budget=self.budget,
            depth=int(self.block_size) - 1,
            vocab_size=self.vocab_size,
            dtype=self.target_worker.model_runner.model.lm_head.weight.dtype,
            device=self.device,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            with_links=self.hybrid,
        )
        try:
            with torch.no_grad():
                graphs.capture(batch_sizes)
        except Exception as e:  # the eager round computes the same values, only slower
            logger.warning("DDTREE round CUDA graph capture failed; running eagerly: %s", e)
            return
        self._round_graphs = graphs
        if self.ps.tp_rank == 0:
            logger.info("DDTREE tree build and commit plan captured for batch sizes %s.", sorted(batch_sizes))

    def _prepare_round(self, batch: ScheduleBatch, draft_input: DFlashDraftInputV2) -> DDTreeRoundTensors:
        draft_logits = self._draft_logits(batch, draft_input)
        if self.debug:
            self._debug_draft_top1 = draft_logits.argmax(dim=-1)
        args = (draft_input.bonus_tokens, batch.seq_lens, batch.req_pool_indices)
        if self._round_graphs is not None:
            return self._round_graphs.prepare(draft_logits, *args)
        return ddtree_prepare_round(
            draft_logits, self.budget, *args, self.model_runner.req_to_token_pool.req_to_token,
            self.hybrid,
        )

    def _commit_round(self, round_tensors: DDTreeRoundTensors, picks: torch.Tensor,
                      prefix_lens: torch.Tensor) -> DDTreeCommit:
        if self._round_graphs is None:
            return ddtree_commit_plan(round_tensors.tree, picks, round_tensors.ids,
                                      round_tensors.slots, prefix_lens)
        plan = self._round_graphs.commit(round_tensors, picks, prefix_lens)
        # What leaves the round must not live in graph memory the next round overwrites.
        return dataclasses.replace(
            plan,
            commit_lens=plan.commit_lens.clone(),
            bonus=plan.bonus.clone(),
            out_tokens=plan.out_tokens.clone(),
            new_seq_lens=plan.new_seq_lens.clone(),
        )

    def _maybe_build_draft_sampler(self):
        # The tree needs the draft's full log-probs, not the folded greedy argmax.
        return None

    def forward_batch_generation(
        self,
        batch: ScheduleBatch,
        on_publish=None,
        grammar_barrier=None,
    ) -> GenerationBatchResult:
        if (
            batch.forward_mode.is_extend()
            or batch.is_extend_in_batch
            or batch.forward_mode.is_idle()
            or batch.spec_info is None
        ):
            return super().forward_batch_generation(batch, on_publish, grammar_barrier)
        if batch.has_grammar:
            if not self._warned_grammar and self.ps.tp_rank == 0:
                logger.warning(
                    "DDTREE: batches with grammar-constrained requests use the DFlash chain round."
                )
                self._warned_grammar = True
            return super().forward_batch_generation(batch, on_publish, grammar_barrier)
        if getattr(batch, "return_logprob", False):
            raise ValueError("DDTREE speculative decoding does not support return_logprob.")
        return self._forward_tree_round(batch, on_publish)

    # ------------------------------------------------------------------ draft
    def _draft_logits(self, batch: ScheduleBatch, draft_input: DFlashDraftInputV2) -> torch.Tensor:
        """Run the DFlash draft once over ``[bonus, MASK x (S-1)]``.

        Returns:
            Draft logits ``[bs, S-1, V]`` (row d-1 is depth d), in the lm_head dtype.
        """
        bs = len(batch.seq_lens)
        block_size = int(self.block_size)
        self._ensure_draft_block_buffers(bs)
        block_ids = self._draft_block_ids_buf[:bs]
        positions_2d = self._draft_block_positions_buf[:bs]
        cache_loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        _prepare_dflash_draft_block_unchecked(
            bonus_tokens=draft_input.bonus_tokens.view(-1),
            prefix_lens=batch.seq_lens.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1),
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            block_ids_out=block_ids,
            positions_out=positions_2d,
            cache_loc_out=cache_loc_2d,
            mask_token_id=int(self._mask_token_id),
        )
        target_model = self.target_worker.model_runner.model
        input_embeds = target_model.get_input_embeddings()(block_ids)
        seq_lens_cpu = self._draft_seq_lens_cpu_buf[:bs]
        if batch.seq_lens_cpu is not None:
            seq_lens_cpu.copy_(batch.seq_lens_cpu)
            seq_lens_cpu.add_(block_size)
            seq_lens_sum = int(seq_lens_cpu.sum())
        else:
            seq_lens_cpu.copy_(draft_input.reserved_seq_lens_cpu)
            seq_lens_sum = int(draft_input.reserved_seq_lens_sum)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=seq_lens_sum,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions_2d.reshape(-1),
            input_embeds=input_embeds.view(-1, input_embeds.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        with torch.inference_mode():
            draft_out = self.draft_model_runner.forward(forward_batch)
        hidden = draft_out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE draft model returned no hidden states.")
        hidden = hidden.view(bs, block_size, -1)[:, 1:, :]
        weight = target_model.lm_head.weight[: self.vocab_size]
        return torch.matmul(hidden.to(weight.dtype), weight.T)

    # ----------------------------------------------------------------- verify
    def _verify_mask(self, tree: DDTreeBatch, prefix_lens: torch.Tensor, host_seq_sum: int) -> torch.Tensor:
        bs = int(prefix_lens.shape[0])
        n = self.verify_width
        # Upper bound from host lengths (never a sync); cells past the batch are unread.
        cells = min(n * host_seq_sum + bs * n * n, bs * n * (self.max_context_len + n))
        if self._mask_buf is None or self._mask_buf.numel() < cells:
            self._mask_buf = torch.ones(max(cells, 1), dtype=torch.bool, device=self.device)
        mask = self._mask_buf[:cells]
        fill_ddtree_verify_mask(
            mask_out=mask, visibility=tree.visibility, prefix_lens=prefix_lens
        )
        return mask

    def _target_picks(self, batch: ScheduleBatch, draft_input: DFlashDraftInputV2, logits: torch.Tensor) -> torch.Tensor:
        """The target's token at every tree node: argmax at T=0, else an
        independent sample from its (temperature, top-k, top-p) distribution."""
        bs, n = len(batch.seq_lens), self.verify_width
        sampling_info = batch.sampling_info
        if sampling_info is None or sampling_info.is_all_greedy:
            return torch.argmax(logits, dim=-1).view(bs, n)
        probs = build_dflash_verify_target_probs(
            next_token_logits=logits,
            sampling_info=sampling_info,
            draft_token_num=n,
            bs=bs,
            max_top_k=draft_input.max_top_k,
            uniform_top_k_value=draft_input.uniform_top_k_value,
        )
        _, picks = fast_sample(probs.view(bs * n, -1), num_samples=1)
        return picks.view(bs, n)

    def _forward_tree_round(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch.")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs, n, block_size = len(batch.seq_lens), self.verify_width, int(self.block_size)
        prefix_lens = batch.seq_lens

        # 1) Draft once, build the tree and the verify inputs on the GPU (one graph replay).
        round_tensors = self._prepare_round(batch, draft_input)
        tree = round_tensors.tree

        # 2) Verify [root] + nodes at positions prefix + depth under the tree mask.
        if batch.seq_lens_cpu is not None:
            host_seq_sum = int(batch.seq_lens_cpu.sum()) + bs * block_size
        else:
            host_seq_sum = int(draft_input.reserved_seq_lens_sum)
        verify_input = DDTreeVerifyInput(
            draft_token=round_tensors.ids.reshape(-1),
            positions=round_tensors.positions.reshape(-1),
            draft_token_num=n,
            custom_mask=self._verify_mask(tree, prefix_lens, host_seq_sum),
            capture_hidden_mode=CaptureHiddenMode.FULL,
            retrieve_next_token=round_tensors.next_token,
            retrieve_next_sibling=round_tensors.next_sibling,
        )
        batch.out_cache_loc = round_tensors.slots.reshape(-1)
        if self.hybrid:
            # Track slots for the radix cache (extra_buffer), committed after the walk.
            prepare_mamba_track_for_verify(batch)
            if self.debug:
                self._state_check_before_verify(batch)
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        if seq_lens_cpu_backup is not None:
            batch.seq_lens_cpu = seq_lens_cpu_backup + n
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        else:
            batch.seq_lens_cpu = draft_input.reserved_seq_lens_cpu
            batch.seq_lens_sum = int(draft_input.reserved_seq_lens_sum)
        verify_forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
        target_out = self.target_worker.forward_batch_generation(
            batch=None,
            forward_batch=verify_forward_batch,
            is_verify=True,
            skip_attn_backend_init=True,
        )
        logits_output = target_out.logits_output
        if batch.sampling_info is not None:
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits_output.next_token_logits,
                sampling_info=batch.sampling_info,
                draft_token_num=n,
            )

        # 3) Walk the target's picks down the tree and plan the commit (one graph replay):
        # the accepted path's slots move right after the prefix (its KV was computed at
        # positions prefix + depth, i.e. in place); the rest stay reserved for the next round.
        picks = self._target_picks(batch, draft_input, logits_output.next_token_logits)
        plan = self._commit_round(round_tensors, picks, prefix_lens)
        if self.hybrid:
            self._commit_recurrent_state(batch, plan)
        if on_publish is not None:
            on_publish(plan.new_seq_lens)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        verify_cols = prefix_lens[:, None] + self._verify_offsets[None, :]
        req_to_token[batch.req_pool_indices[:, None], verify_cols] = plan.committed_slots.to(
            req_to_token.dtype
        )

        # 4) Draft KV for the committed tokens only (root + accepted nodes).
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, but got None.")
        hidden = hidden.view(bs, n, -1).gather(
            1, plan.path[:, :, None].expand(-1, -1, hidden.shape[-1])
        )
        block_locs = plan.committed_slots[:, :block_size].contiguous()
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden.reshape(-1, hidden.shape[-1]),
            cache_loc=block_locs.reshape(-1),
            cache_loc_2d=block_locs,
            positions=(prefix_lens[:, None] + self._verify_offsets[None, :block_size]).reshape(-1),
            commit_lens=plan.commit_lens,
        )
        logits_output.hidden_states = None
        if self.debug:
            self._log_debug(batch, tree, picks, plan, self._hybrid_debug(tree, plan))

        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=plan.out_tokens.reshape(-1),
            accept_lens=plan.commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(
                bonus_tokens=plan.bonus, new_seq_lens=plan.new_seq_lens
            ),
            speculative_num_draft_tokens=block_size,
            new_seq_lens=plan.new_seq_lens,
        )

    # ----------------------------------------------------------- hybrid state
    def _commit_recurrent_state(self, batch: ScheduleBatch, plan: DDTreeCommit) -> None:
        """Copy each request's conv window and SSM state at its last accepted node
        into its committed state (every round: the tree verify overwrites the
        committed conv window in place), plus the interval-crossing node's into the
        radix track slot, as SGLang's EAGLE tree verify commits them."""
        bs, n = int(plan.path.shape[0]), self.verify_width
        rows = torch.arange(bs, dtype=plan.path.dtype, device=plan.path.device)
        accept_index = plan.path + rows[:, None] * n  # flat node indices, as EAGLE's
        commit_mamba_states_after_verify(
            self.target_worker, batch, plan.commit_lens, accept_index, n
        )

    def _linear_attn_backend(self):
        return self.target_worker.model_runner.attn_backend.linear_attn_backend

    def _state_check_before_verify(self, batch: ScheduleBatch) -> None:
        pool = self.model_runner.req_to_token_pool
        if self._state_check is None:
            def layer_cache(layer_id: int):
                cache = pool.mamba2_layer_cache(layer_id)
                return cache.conv[0], cache.temporal

            self._state_check = DDTreeStateCheck(layer_cache, sorted(pool.mamba_map))
            self._state_check.install(self._linear_attn_backend())
        self._state_check.before_verify(pool.get_mamba_indices(batch.req_pool_indices))

    def _hybrid_debug(self, tree: DDTreeBatch, plan: DDTreeCommit) -> List[Dict[str, object]]:
        """Per request: whether the conv kernel derived the tree's parents from the
        links, and the committed-state check (``DDTreeStateCheck``)."""
        bs = int(plan.path.shape[0])
        if not self.hybrid:
            return [{} for _ in range(bs)]
        derived = self._linear_attn_backend().forward_metadata.retrieve_parent_token
        parents_ok = (
            (derived[:bs].to(torch.int64) == ddtree_link_parents(tree.parents)).all(dim=1).tolist()
            if derived is not None
            else [None] * bs
        )
        checks = self._state_check.after_commit(plan.path, plan.commit_lens, self.verify_width)
        return [{"link_parents_ok": ok, "state_check": c} for ok, c in zip(parents_ok, checks, strict=True)]

    def _log_debug(
        self,
        batch: ScheduleBatch,
        tree: DDTreeBatch,
        picks: torch.Tensor,
        plan: DDTreeCommit,
        hybrid: List[Dict[str, object]],
    ) -> None:
        """One JSON line per request and round (host sync: debug only). A request's lines
        give its rounds, the histogram of acceptance lengths, tree sizes and depths, and
        the draft's top-1 agreement per depth (1, 0, or -1 where the target's token there
        is unknown this round)."""
        nodes = tree.num_nodes.tolist()
        node_ok = self._verify_offsets[None, 1:] <= tree.num_nodes[:, None]
        max_depth = torch.where(node_ok, tree.depths, 0).max(dim=1).values.tolist()
        accept = plan.commit_lens.tolist()
        agreement = draft_top1_agreement(
            self._debug_draft_top1, picks, plan.path, plan.commit_lens.to(torch.int64)
        ).tolist()
        for i, req in enumerate(batch.reqs):
            logger.info(
                "ddtree_debug %s",
                json.dumps(
                    {
                        "rid": req.rid,
                        "budget": self.budget,
                        "tree_nodes": nodes[i],
                        "tree_depth": max_depth[i],
                        "accepted_nodes": accept[i] - 1,
                        "accept_length": accept[i],
                        "draft_top1_agree": agreement[i],
                        **hybrid[i],
                    }
                ),
            )
