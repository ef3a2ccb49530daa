"""Turn the scheduler's choice for one step into a StepPlan of flat arrays.

This runs every step for up to `max_num_seqs` sequences, so it avoids per-sequence numpy
calls: each field is one list comprehension turned into one array, block tables are one
vectorised gather from the block manager's mirror, and what cannot change between steps
(sampling parameters, seeds, prompt lengths, mirror rows) is reused while the step runs the
same sequences as the previous one, which is every decode step between admissions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from common.plan import DEFERRED_INPUT, SamplingBatch, StepPlan
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.lora.adapter_slots import AdapterSlots
from scheduler_svc.sched.sequence import Sequence
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.text.grammar_matcher import fill_masks, first_mask_rows


class PlanBuilder:
    def __init__(
        self,
        bm: BlockManager,
        slots: AdapterSlots | None = None,
        groups: Mapping[int, SequenceGroup] | None = None,
        speculative: bool = False,
    ) -> None:
        self.bm = bm
        self.speculative = speculative  # rows may carry draft tokens (Sequence.draft)
        self.slots = slots if slots is not None else AdapterSlots(0)
        # The scheduler's group index (Queues.groups): a row's adapter and prompt scores are its group's.
        self.groups: Mapping[int, SequenceGroup] = groups if groups is not None else {}
        self._ids: list[int] = []
        self._rows_epoch = -1
        self._slots_epoch = -1
        self._static: dict[str, np.ndarray] = {}
        self._biased: list[int] = []  # rows with a logit bias or a min_tokens ban
        self._penalized: list[int] = []  # rows whose penalties need the token history
        self._prompt_scored: list[int] = []  # rows that asked for prompt log-probabilities
        self._constrained: list[int] = []  # rows with a structured output's grammar

    def build(self, step_id: int, seqs: list[Sequence], query_lens: list[int]) -> StepPlan:
        """Sequence i feeds tokens [computed, computed + query_lens[i]) of its token list."""
        bm = self.bm
        n = len(seqs)
        ids = [s.seq_id for s in seqs]
        if ids != self._ids:
            self._ids = ids
            self._static = _static_fields(seqs)
            self._biased = [i for i, q in enumerate(seqs) if q.sampling.logit_bias or q.stopping.min_tokens]
            self._penalized = [i for i, q in enumerate(seqs) if q.sampling.penalized]
            self._prompt_scored = [i for i, q in enumerate(seqs) if q.sampling.prompt_logprobs is not None]
            self._constrained = [i for i, q in enumerate(seqs) if q.grammar is not None]
            self._rows_epoch = -1
            self._slots_epoch = -1
        if self._slots_epoch != self.slots.epoch:
            # A running group keeps its slot (a referenced slot is never refilled), so rows'
            # slots change only with a load or a reset, which move the epoch.
            self._static["lora_slots"] = _lora_slots(seqs, self.slots, self.groups)
            self._slots_epoch = self.slots.epoch
        if self._rows_epoch != bm.rows_epoch:
            self._static["rows"] = bm.rows_of(ids)
            self._rows_epoch = bm.rows_epoch
        st = self._static
        q = np.array(query_lens, dtype=np.int32)
        computed = [s.num_computed_tokens for s in seqs]
        # A token a plan in flight will sample (Sequence.pending) is fed as DEFERRED_INPUT: the
        # worker takes what it sampled for that sequence in the step before.
        if n and max(query_lens) == 1:
            input_ids = np.array(
                [s.token_ids[c] if c < len(s.token_ids) else DEFERRED_INPUT for s, c in zip(seqs, computed)],
                dtype=np.int32,
            )
        else:
            flat: list[int] = []
            for s, c, k in zip(seqs, computed, query_lens):
                if s.draft:  # its last token, then the drafts to verify
                    flat.extend(s.token_ids[c:])
                    flat.extend(s.draft)
                    continue
                flat.extend(s.token_ids[c : c + k])
                flat.extend([DEFERRED_INPUT] * (c + k - max(c, len(s.token_ids))))
            input_ids = np.array(flat, dtype=np.int32)
        context_lens = np.array(computed, dtype=np.int32)
        num_tokens = np.array([len(s.token_ids) + s.pending for s in seqs], dtype=np.int32)
        ends = context_lens + q
        draft_lens = np.array([len(s.draft) for s in seqs], dtype=np.int32) if self.speculative else _NONE_I32
        if draft_lens.size and not draft_lens.any():
            draft_lens = _NONE_I32
        propose_lens = np.array([s.propose for s in seqs], dtype=np.int32) if self.speculative else _NONE_I32
        if propose_lens.size and not propose_lens.any():
            propose_lens = _NONE_I32
        # A row's drafts sit past its tokens: it samples when they end where its tokens do.
        sample = (ends == num_tokens + draft_lens if draft_lens.size else ends == num_tokens).astype(np.uint8)
        bias = _bias(seqs, [i for i in self._biased if sample[i]], n)
        history = _history(seqs, [i for i in self._penalized if sample[i]], n)
        prompt_asked, prompt_next = _prompt_scoring(seqs, computed, query_lens, self._prompt_scored, self.groups)
        mask_rows, token_masks = _masks(seqs, [i for i in self._constrained if sample[i]], n)
        swap_out, swap_in, copy = bm.take_ops()
        return StepPlan(
            step_id=step_id,
            seq_ids=st["seq_ids"],
            query_lens=q,
            context_lens=context_lens,
            input_ids=input_ids,
            # A sequence fed up to position e owns exactly ceil(e / block_size) blocks, and those
            # its draft model's proposing writes past e.
            block_tables=bm.tables_at(
                st["rows"], -(-(ends + propose_lens if propose_lens.size else ends) // bm.block_size)
            ),
            sample=sample,
            sampling=SamplingBatch(
                temperature=st["temperature"],
                top_p=st["top_p"],
                top_k=st["top_k"],
                seed=st["seed"],
                output_position=num_tokens - st["prompt_lens"],
                num_logprobs=st["num_logprobs"],
                min_p=st["min_p"],
                repetition_penalty=st["repetition_penalty"],
                presence_penalty=st["presence_penalty"],
                frequency_penalty=st["frequency_penalty"],
                bias_offsets=bias[0],
                bias_token_ids=bias[1],
                bias_values=bias[2],
                history_offsets=history[0],
                history_token_ids=history[1],
                prompt_logprobs=prompt_asked,
                prompt_next_token=prompt_next,
                mask_rows=mask_rows,
                token_masks=token_masks,
            ),
            swap_out=swap_out,
            swap_in=swap_in,
            copy=copy,
            adapter_loads=self.slots.take_loads(),
            lora_slots=st["lora_slots"],
            draft_lens=draft_lens,
            propose_lens=propose_lens,
        )


def _lora_slots(seqs: list[Sequence], slots: AdapterSlots, groups: Mapping[int, SequenceGroup]) -> np.ndarray:
    """Each row's LoRA slot, -1 for the base model; empty when no row has an adapter."""
    adapters = [groups[s.group_id].adapter for s in seqs]
    if not any(adapters):
        return _NONE_I32
    return np.array([slots.slot_of(a) if a is not None else -1 for a in adapters], dtype=np.int32)


_NONE_I32 = np.zeros(0, np.int32)
_NONE_F32 = np.zeros(0, np.float32)
_NO_MASKS = np.zeros((0, 0), np.int32)


def _bias(seqs: list[Sequence], rows: list[int], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ragged (offsets, token ids, values): logit_bias, plus -inf on the stop tokens of a
    sequence that has not reached min_tokens yet."""
    if not rows:
        return _NONE_I32, _NONE_I32, _NONE_F32
    counts = np.zeros(n + 1, np.int32)
    ids: list[int] = []
    values: list[float] = []
    for i in rows:
        seq = seqs[i]
        pairs = list(seq.sampling.logit_bias)
        if seq.num_output_tokens + seq.pending < seq.stopping.min_tokens:
            pairs += [(t, float("-inf")) for t in sorted(seq.stop_ids)]
        counts[i + 1] = len(pairs)
        ids.extend(t for t, _ in pairs)
        values.extend(v for _, v in pairs)
    return np.cumsum(counts, dtype=np.int32), np.array(ids, np.int32), np.array(values, np.float32)


def _masks(seqs: list[Sequence], rows: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask_rows [n], token_masks [k, words]): what each constrained row that samples may
    draw next, and a row verifying d drafts at each of its d + 1 positions (masks
    mask_rows[i] .. mask_rows[i] + d; its drafts are ones the grammar allows, StepPlanner._draft).
    Never planned ahead (Scheduler._plan_ahead), so each grammar has seen every token before
    the one this step samples."""
    if not rows:
        return _NONE_I32, _NO_MASKS
    drafts = [seqs[i].draft for i in rows]
    mask_rows = np.full(n, -1, np.int32)
    mask_rows[rows] = first_mask_rows(drafts)
    grammars = [seqs[i].grammar for i in rows]
    assert all(grammars), "a constrained row without a grammar"
    return mask_rows, fill_masks(grammars, drafts)  # type: ignore[arg-type]


def _history(seqs: list[Sequence], rows: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged (offsets, token ids): the whole token list of each penalized sequence that samples.

    Each sequence keeps its tokens in a growing int32 buffer (only new tokens are copied in),
    so a step costs one memcpy per row, not a Python loop over thousands of tokens.
    """
    if not rows:
        return _NONE_I32, _NONE_I32
    counts = np.zeros(n + 1, np.int32)
    parts = []
    for i in rows:
        tokens = _token_buffer(seqs[i])
        counts[i + 1] = tokens.shape[0]
        parts.append(tokens)
    return np.cumsum(counts, dtype=np.int32), np.concatenate(parts)


def _token_buffer(seq: Sequence) -> np.ndarray:
    buffer, size = seq.token_buffer
    total = len(seq.token_ids)
    if total > buffer.shape[0]:
        grown = np.empty(max(2 * buffer.shape[0], total, 64), np.int32)
        grown[:size] = buffer[:size]
        buffer = grown
    if total > size:
        buffer[size:total] = seq.token_ids[size:total]
    seq.token_buffer = (buffer, total)
    return buffer[:total]


def _prompt_scoring(
    seqs: list[Sequence],
    computed: list[int],
    query_lens: list[int],
    rows: list[int],
    groups: Mapping[int, SequenceGroup],
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: prompt log-probability alternatives wanted (-1 = none) and the prompt token
    after the chunk (-1 past the prompt). A row is scored while its group still lacks scores
    and its chunk reaches the first missing position, however chunks fell (a recompute may
    chunk differently); the scheduler keeps only the entries it lacks."""
    if not rows:
        return _NONE_I32, _NONE_I32
    asked = np.full(len(seqs), -1, np.int32)
    following = np.full(len(seqs), -1, np.int32)
    for i in rows:
        seq, c = seqs[i], computed[i]
        prompt_len, have = len(seq.prompt_token_ids), len(groups[seq.group_id].prompt_logprobs)
        end = c + query_lens[i]
        # Positions c..end-1 score tokens c+1..end; the next one wanted is have + 1.
        if have < prompt_len - 1 and c <= have < end:
            asked[i] = seq.sampling.prompt_logprobs or 0
            following[i] = seq.prompt_token_ids[end] if end < prompt_len else -1
    return asked, following


def beam_candidates(seq: Sequence) -> int:
    """Candidates a beam step ranks per beam: (1 + stop tokens) x width, at least 2 x width, as
    in transformers, so that W candidates that do not end always remain."""
    width = seq.sampling.beam_width
    return (1 + max(1, len(seq.stop_ids))) * width if width > 1 else 0


def _static_fields(seqs: list[Sequence]) -> dict[str, np.ndarray]:
    params = [s.sampling for s in seqs]
    penalized = any(p.penalized for p in params)

    def optional(values: list[float], used: bool) -> np.ndarray:
        return np.array(values, dtype=np.float32) if used else _NONE_F32

    return {
        "min_p": optional([p.min_p for p in params], any(p.min_p > 0 for p in params)),
        "repetition_penalty": optional([p.repetition_penalty for p in params], penalized),
        "presence_penalty": optional([p.presence_penalty for p in params], penalized),
        "frequency_penalty": optional([p.frequency_penalty for p in params], penalized),
        "seq_ids": np.array([s.seq_id for s in seqs], dtype=np.int64),
        "temperature": np.array([p.temperature for p in params], dtype=np.float32),
        "top_p": np.array([p.top_p for p in params], dtype=np.float32),
        "top_k": np.array([p.top_k for p in params], dtype=np.int32),
        "seed": np.array([s.seed for s in seqs], dtype=np.uint64).view(np.int64),
        "prompt_lens": np.array([len(s.prompt_token_ids) for s in seqs], dtype=np.int32),
        "num_logprobs": np.array([beam_candidates(s) or (s.sampling.logprobs or 0) for s in seqs], dtype=np.int32),
    }
