"""One step on the worker: plan arrays -> input tensors -> forward -> sampled tokens.

The runner keeps no per-request state between steps: everything it needs comes in the plan,
and its memory is the weights and the KV-cache tensors, plus the tokens its last step
sampled, which a plan the scheduler made before that step's result arrived refers to
(DEFERRED_INPUT in common/plan.py); a pipeline stage's plans never do. What it builds before
its first step (the model, the cache's size, the warm-up) is its base class's, in
runner_setup.py.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from common.plan import DEFERRED_INPUT, AdapterLoad, SamplingBatch, StepPlan, StepResult
from worker_svc.device.host_copy import to_device, to_host
from worker_svc.lora.adapter_cache import HostAdapter
from worker_svc.sampling.draft_verifier import Verdict, verify
from worker_svc.sampling.logits_processor import process_logits, processed_rows
from worker_svc.sampling.logprobs import logits_stats, logprob_arrays, logprob_tensors, prompt_logprobs
from worker_svc.sampling.sampler import sample
from worker_svc.step.cuda_graphs import fits, stage
from worker_svc.step.runner_setup import RunnerSetup
from worker_svc.step.step_buckets import pad_rows


class PlanError(ValueError):
    """A plan that would read or write outside this worker's cache or model."""


class ModelRunner(RunnerSetup):
    """`group`: the tensor-parallel group this runner is a rank of; every rank must run the
    same plans in the same order (the forward holds collectives)."""

    def check(self, plan: StepPlan) -> None:
        try:
            plan.validate()
        except ValueError as error:
            raise PlanError(str(error)) from error
        self._check_block_ops(plan)
        if plan.num_seqs == 0:
            return
        if self.step_token_limit is not None and plan.num_tokens > self.step_token_limit:
            raise PlanError(
                f"{plan.num_tokens} tokens in one step, above the kernels' limit of {self.step_token_limit}"
            )
        bt, bs = plan.block_tables, self.block_size
        ends = plan.context_lens.astype(np.int64) + plan.query_lens
        if int(plan.context_lens.min()) < 0 or int(ends.max()) > self.max_model_len:
            raise PlanError(f"positions outside the model's context of {self.max_model_len}")
        needed = -(-ends // bs)  # blocks each sequence uses after this step
        if bool((bt.lens < needed).any()):
            raise PlanError("block tables too short for the sequences' lengths")
        used = bt.take(np.arange(plan.num_seqs), needed).ids  # every entry a token lives in
        if used.size and (int(used.min()) < 0 or int(used.max()) >= self.kv.num_blocks):
            raise PlanError(f"block id outside the cache of {self.kv.num_blocks} blocks")
        vocab = self.shape.vocab_size
        for name, ids in (
            ("input_ids", plan.input_ids),
            ("sampling.bias_token_ids", plan.sampling.bias_token_ids),
            ("sampling.history_token_ids", plan.sampling.history_token_ids),
        ):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise PlanError(f"{name}: token id outside the vocabulary of {vocab}")
        nxt = plan.sampling.prompt_next_token
        if nxt.size and (int(nxt.min()) < -1 or int(nxt.max()) >= vocab):
            raise PlanError("sampling.prompt_next_token outside the vocabulary")
        plp = plan.sampling.prompt_logprobs
        if plp.size and int(plp.max()) > vocab:
            raise PlanError(f"sampling.prompt_logprobs above the vocabulary of {vocab}")
        rep = plan.sampling.repetition_penalty
        if rep.size and not bool((rep > 0).all()):
            raise PlanError("sampling.repetition_penalty must be positive")
        asked = plan.sampling.num_logprobs
        if asked.size and (int(asked.min()) < 0 or int(asked.max()) > self.shape.vocab_size):
            raise PlanError(f"num_logprobs outside [0, {self.shape.vocab_size}]")
        self._check_lora(plan)
        drafted = np.flatnonzero(plan.draft_lens) if plan.draft_lens.size else plan.draft_lens
        s = plan.sampling
        if drafted.size and (
            processed_rows(s, drafted, masks=False).any()  # a grammar's masks verify per position
            or (s.num_logprobs.size and s.num_logprobs[drafted].any())
            or (s.prompt_logprobs.size and (s.prompt_logprobs[drafted] >= 0).any())
        ):
            raise PlanError("draft tokens for a sequence with a bias, penalties, alternatives or prompt scores")
        self._check_proposals(plan, ends)

    def _check_proposals(self, plan: StepPlan, ends: np.ndarray) -> None:
        """Rows that propose: a draft model to propose with, and table and positions for it."""
        asked = plan.propose_lens
        if not (asked.size and asked.any()):
            return
        if self.draft is None:
            raise PlanError("a plan asks for draft proposals, and this worker has no draft model (--speculative-model)")
        reach = ends + asked
        if int(reach.max()) > self.max_model_len:
            raise PlanError(f"proposals past the model's context of {self.max_model_len}")
        rows = np.flatnonzero(asked)
        needed = -(-reach[rows] // self.block_size)
        if bool((plan.block_tables.lens[rows] < needed).any()):
            raise PlanError("block tables too short for the proposals asked")
        ids = plan.block_tables.take(rows, needed).ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.kv.num_blocks:
            raise PlanError(f"block id outside the cache of {self.kv.num_blocks} blocks")

    def _check_lora(self, plan: StepPlan) -> None:
        if self.lora is None:
            if plan.adapter_loads or (plan.lora_slots.size and int(plan.lora_slots.max()) >= 0):
                raise PlanError("a plan with LoRA adapters, and this worker has no adapter slots (--enable-lora)")
            return
        try:
            self.lora.check(plan.lora_slots, plan.adapter_loads)
        except ValueError as error:
            raise PlanError(str(error)) from error

    def _prepare_adapters(self, plan: StepPlan) -> list[tuple[AdapterLoad, HostAdapter]]:
        """The plan's adapter loads read and checked against the model before anything of this
        worker changes: a bad adapter refuses the plan with the cache and the slots untouched."""
        if self.lora is None or not plan.adapter_loads:
            return []
        try:
            return self.lora.prepare(plan.adapter_loads)
        except ValueError as error:
            raise PlanError(str(error)) from error

    def _check_block_ops(self, plan: StepPlan) -> None:
        """Every (src, dst) id inside its pool, and no block written twice (the result would
        depend on the order of the scatter)."""
        device, host = ("device", self.kv.num_blocks), ("host", self.kv.num_cpu_blocks)
        for name, pools in (("swap_out", (device, host)), ("swap_in", (host, device)), ("copy", (device, device))):
            ops = getattr(plan, name)
            if not len(ops):
                continue
            for column, role, (pool, size) in zip(ops.T, ("source", "destination"), pools):
                if int(column.min()) < 0 or int(column.max()) >= size:
                    raise PlanError(f"{name} {role} block outside the {pool} pool of {size} blocks")
            if np.unique(ops[:, 1]).size != len(ops):
                raise PlanError(f"{name} writes a {pools[1][0]} block twice")

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, Any, np.ndarray]:
        """(input ids, positions, attention metadata) of the forward pass, and query start
        offsets [seqs + 1]. On the CPU kernels the rows are padded to a GEMM bucket
        (worker_svc/step/step_buckets.py); the forward pass then returns that many rows."""
        n, q, c, bs = plan.num_seqs, plan.query_lens, plan.context_lens, self.block_size
        starts = self.model.attention.query_starts(q).astype(np.int64)
        # token t of sequence i sits at position c[i] + (t - starts[i])
        seq_of_token = np.repeat(np.arange(n), q)
        positions = np.arange(plan.num_tokens) + np.repeat(c - starts[:-1], q)
        slots = plan.block_tables.lookup(seq_of_token, positions // bs) * bs + positions % bs
        input_ids = plan.input_ids.astype(np.int64)
        adapters = np.repeat(plan.lora_slots, q) if plan.lora_slots.size else None  # a slot per token
        if self._gemm_buckets is not None:
            rows = self._gemm_buckets.pad(plan.num_tokens)
            input_ids, positions, slots = (
                pad_rows(input_ids, rows, 0),
                pad_rows(positions, rows, 0),
                pad_rows(slots, rows, -1),
            )
            if adapters is not None:
                adapters = pad_rows(adapters, rows, -1)
        if self.lora is not None:
            self.lora.begin_step(adapters)
        meta = self.model.attention.build_metadata(q, c, plan.block_tables, slots, bs, self.device)
        return to_device(input_ids, self.device), to_device(positions, self.device), meta, starts

    def _section(self, part: str) -> AbstractContextManager[None]:
        return self._profile.section(part) if self._profile is not None else nullcontext()

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits of every fed token (tests compare them with the reference)."""
        self.check(plan)
        adapters = self._prepare_adapters(plan)
        if adapters and self.lora is not None:
            self.lora.apply(adapters)
        input_ids, positions, meta, _ = self._inputs(plan)
        return self.model.compute_logits(self.model(input_ids, positions, self.kv.layers, meta)[: plan.num_tokens])

    def _fill_deferred(self, plan: StepPlan) -> StepPlan:
        """The plan with each DEFERRED_INPUT replaced by the token this worker sampled for that
        sequence in its previous step (the scheduler planned this step before knowing it)."""
        where = np.flatnonzero(plan.input_ids == DEFERRED_INPUT)
        if not where.size:
            return plan
        if self.stage.pipelined:
            raise PlanError(
                "a deferred input in a plan for a pipeline stage (its plans name only tokens already known)"
            )
        try:
            plan.validate()  # the offsets below assume consistent arrays
        except ValueError as error:
            raise PlanError(str(error)) from error
        ends = np.cumsum(plan.query_lens)
        rows = np.searchsorted(ends, where, side="right")  # the sequence of each deferred token
        if not np.array_equal(ends[rows] - 1, where):
            raise PlanError("a deferred input that is not its sequence's last fed token")
        input_ids = plan.input_ids.copy()
        for token_index, seq_id in zip(where.tolist(), plan.seq_ids[rows].tolist()):
            token = self._last_sampled.get(seq_id)
            if token is None:
                raise PlanError(
                    f"a deferred input for sequence {seq_id}, which this worker's previous step did not sample"
                )
            input_ids[token_index] = token
        return dataclasses.replace(plan, input_ids=input_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        with self._section("prepare"):
            plan = self._fill_deferred(plan)
            self.check(plan)
            adapters = self._prepare_adapters(plan)
            # The plan's order (common.plan.StepPlan): copies come last because their source
            # may be a block swapped in this step.
            self.kv.swap_out(plan.swap_out)
            self.kv.swap_in(plan.swap_in)
            self.kv.copy(plan.copy)
            if self.draft is not None:
                self.draft.block_ops(plan)
            if adapters and self.lora is not None:
                self.lora.apply(adapters)
            sampled = np.full(plan.num_seqs, -1, dtype=np.int32)
            graphs = self._graphs
            # A step with adapted rows runs eagerly: the graphs were captured without LoRA.
            adapted = bool(plan.lora_slots.size) and int(plan.lora_slots.max()) >= 0
            bucket = fits(plan, graphs.buckets, graphs.width) if graphs is not None and not adapted else None
            if bucket is not None:  # a decode step a captured graph replays
                staged = stage(plan, bucket, graphs.width, self.block_size)  # type: ignore[union-attr]
                starts = np.arange(plan.num_seqs + 1)
            elif plan.num_seqs:
                input_ids, positions, meta, starts = self._inputs(plan)
        if plan.num_seqs == 0:
            self._last_sampled = {}
            return StepResult(plan.step_id, sampled, time.perf_counter() - start, part_seconds=self._parts())
        with self._section("forward"):
            if bucket is not None:
                hidden = graphs.run(staged)  # type: ignore[union-attr]
            else:
                hidden = self.model(input_ids, positions, self.kv.layers, meta)
        if self.draft is not None:
            with self._section("draft"):
                self.draft.follow(input_ids, positions, meta)
        if not self.stage.is_last:
            # Its result carries no tokens (the last stage's is the group's) and paces nothing:
            # the stage is free for the next micro-batch as soon as its hidden states are sent.
            return StepResult(plan.step_id, sampled, time.perf_counter() - start, part_seconds=self._parts())
        rows = np.flatnonzero(plan.sample)  # no rows: every tensor below is empty, nothing breaks
        spec = rows[plan.draft_lens[rows] > 0] if plan.draft_lens.size else rows[:0]  # rows verifying drafts
        if spec.size:
            rows = rows[plan.draft_lens[rows] == 0]
        dev = self.device
        last = starts[1:][rows] - 1
        if self._gemm_buckets is not None:
            last = pad_rows(last, self._gemm_buckets.pad(rows.size), 0)
        # [len(rows), vocab]
        logits = self.model.compute_logits(hidden.index_select(0, to_device(last, dev)), upcast=False)[: rows.size]
        with self._section("sampling"):
            s = plan.sampling
            tokens, lse = self._sample(logits, s, rows)
            chosen, top_values, top_indices = logprob_tensors(logits, lse, tokens, rows, s.num_logprobs)
            host = to_host(tokens, chosen, top_values, top_indices)  # the step's only wait for the device
            sampled[rows] = host[0]
            logprobs, top_ids, top_lps = logprob_arrays(host[1], host[2], host[3], rows, s.num_logprobs, plan.num_seqs)
            spec_fields: dict[str, np.ndarray] = {}
            if spec.size:
                verdict = self._verify(plan, hidden, starts, spec)
                sampled[spec] = verdict.tokens
                logprobs = logprobs if logprobs.size else np.full(plan.num_seqs, np.nan, np.float32)
                logprobs[spec] = verdict.logprobs
                accepted = np.zeros(plan.num_seqs, np.int32)
                accepted[spec] = verdict.accepted
                spec_fields = {"num_accepted": accepted, "draft_logprobs": verdict.draft_logprobs}
            if not self.stage.pipelined:  # a pipeline's plans name no token in flight
                done = np.flatnonzero(plan.sample)
                self._last_sampled = dict(zip(plan.seq_ids[done].tolist(), sampled[done].tolist()))
        if plan.propose_lens.size and plan.propose_lens.any():
            with self._section("draft"):
                spec_fields["draft_proposals"] = self._propose(plan, sampled, spec_fields.get("num_accepted"))
        prompt: dict[str, np.ndarray] = {}
        if s.prompt_logprobs.size and int(s.prompt_logprobs.max()) >= 0:
            fields = ("prompt_offsets", "prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs")
            values = prompt_logprobs(
                self.model.compute_logits, hidden, starts, plan.input_ids, s.prompt_logprobs, s.prompt_next_token
            )
            prompt = dict(zip(fields, values))
        return StepResult(
            plan.step_id,
            sampled,
            time.perf_counter() - start,
            logprobs,
            top_ids,
            top_lps,
            part_seconds=self._parts(),
            **prompt,
            **spec_fields,
        )

    def _verify(self, plan: StepPlan, hidden: torch.Tensor, starts: np.ndarray, spec: np.ndarray) -> Verdict:
        """The drafts of rows `spec` checked against the logits of their last d + 1 positions."""
        lens = plan.draft_lens[spec]
        ends = starts[1:][spec]
        positions = np.concatenate([np.arange(e - d - 1, e) for e, d in zip(ends.tolist(), lens.tolist())])
        drafts = np.concatenate([plan.input_ids[e - d : e] for e, d in zip(ends.tolist(), lens.tolist())])
        logits = self.model.compute_logits(hidden.index_select(0, to_device(positions, self.device)), upcast=False)
        return verify(logits, drafts, lens, plan.sampling, spec, self._cpu_kernels)

    def _propose(self, plan: StepPlan, sampled: np.ndarray, accepted: np.ndarray | None) -> np.ndarray:
        """The draft model's proposals for the rows that ask, from the token each just sampled,
        which sits after the fed tokens less the rejected drafts."""
        assert self.draft is not None
        rows = np.flatnonzero(plan.propose_lens)
        at = plan.context_lens[rows].astype(np.int64) + plan.query_lens[rows]
        if accepted is not None:
            at -= plan.draft_lens[rows] - accepted[rows]
        pad = self._gemm_buckets.pad if self._gemm_buckets is not None else None
        tables = plan.block_tables.take(rows)
        return self.draft.propose(sampled[rows], at, tables, plan.propose_lens[rows], pad)

    def _sample(self, logits: torch.Tensor, s: SamplingBatch, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logsumexp) of the sampled rows' raw logits [len(rows), vocab]."""
        argmax, lse = logits_stats(logits, self._cpu_kernels)
        # Rows whose token is not simply the argmax of the raw logits: drawn at random, or
        # with logit processing (bias, min_tokens bans, penalties, a structured output's
        # mask). Only they go to float32.
        slow = np.flatnonzero((s.temperature[rows] > 0) | processed_rows(s, rows)) if rows.size else rows
        if not slow.size:
            return argmax, lse
        sub = rows[slow]
        dev = logits.device
        index = to_device(slow, dev)

        processed = process_logits(logits.index_select(0, index).float(), s, sub)
        min_p = s.min_p[sub] if s.min_p.size else None
        drawn = sample(
            processed, s.temperature[sub], s.top_p[sub], s.top_k[sub], s.seed[sub], s.output_position[sub], min_p
        )
        return argmax.index_copy(0, index, drawn), lse

    def _parts(self) -> dict[str, float]:
        return self._profile.take() if self._profile is not None else {}
