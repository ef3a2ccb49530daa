"""The step plan and its result: everything a stateless worker needs for one step.

Both sides hold these as numpy arrays (never per-sequence Python objects), because a plan of
hundreds of sequences is built, encoded and decoded every few milliseconds. The wire form is
packed little-endian bytes of the same arrays (`common.worker_wire`).

Token layout of one step, for three sequences fed 3, 1 and 2 tokens:

    input_ids        [ a0 a1 a2 | b0 | c0 c1 ]
    query_lens       [    3     |  1 |   2   ]
    context_lens     [   c_a    | c_b|  c_c  ]   tokens already in the cache before this step
    position of a1 = c_a + 1; a sequence's tokens are positions [c, c + q) of that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from common.block_tables import BlockTables

# An input token the scheduler does not know yet: the token the worker sampled for the same
# sequence in its previous step (the scheduler planned this step before that one's result came).
DEFERRED_INPUT = -1

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class SamplingBatch:
    """Per-sequence sampling parameters, one entry per sequence of the plan."""

    temperature: F32  # 0 = greedy
    top_p: F32  # 1 = off
    top_k: I32  # 0 = off
    seed: I64  # reinterpreted uint64 bits
    # Index of the output token sampled this step (0 for the first). With the seed it fixes
    # the randomness, so a recomputed or re-batched sequence draws the same token.
    output_position: I32
    # How many most likely alternatives to return with the sampled token's log-probability
    # (0 = none); beam search asks for 2 * beam_width.
    num_logprobs: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    # Logits processing; empty arrays mean "off for every sequence".
    min_p: F32 = field(default_factory=lambda: np.zeros(0, np.float32))  # [num_seqs], 0 = off
    repetition_penalty: F32 = field(default_factory=lambda: np.zeros(0, np.float32))  # [num_seqs], 1 = off
    presence_penalty: F32 = field(default_factory=lambda: np.zeros(0, np.float32))  # [num_seqs]
    frequency_penalty: F32 = field(default_factory=lambda: np.zeros(0, np.float32))  # [num_seqs]
    # Ragged per sequence: sequence i adds bias_values[o[i]:o[i+1]] to the logits of
    # bias_token_ids[o[i]:o[i+1]], o = bias_offsets [num_seqs + 1]. -inf bans a token
    # (min_tokens bans eos and stop tokens this way).
    bias_offsets: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    bias_token_ids: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    bias_values: F32 = field(default_factory=lambda: np.zeros(0, np.float32))
    # Ragged per sequence: the tokens so far (prompt then output) of penalized sequences, empty
    # for the others; the last output_position of them are the output. The worker keeps no
    # history, so penalties work from this alone.
    history_offsets: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    history_token_ids: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    # Prompt log-probabilities: alternatives wanted per sequence, -1 = none (empty = none
    # anywhere). Each fed position's next prompt token is scored; for the chunk's last
    # position that is prompt_next_token (-1 when the chunk ends the prompt).
    prompt_logprobs: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_next_token: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    # Structured outputs: sequence i's sampled token must be allowed by token_masks[mask_rows[i]]
    # (-1 = unconstrained; empty = none anywhere), packed bitmasks [k, ceil(vocab / 32)] whose
    # bit j of word w allows token 32 w + j. The scheduler's grammar matchers fill them. A
    # sequence verifying d drafts has d + 1 masks from mask_rows[i] on, one per position.
    mask_rows: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    token_masks: I32 = field(default_factory=lambda: np.zeros((0, 0), np.int32))

    @classmethod
    def empty(cls) -> SamplingBatch:
        return cls(
            temperature=np.zeros(0, np.float32),
            top_p=np.zeros(0, np.float32),
            top_k=np.zeros(0, np.int32),
            seed=np.zeros(0, np.int64),
            output_position=np.zeros(0, np.int32),
        )


def no_block_ops() -> I32:
    return np.zeros((0, 2), np.int32)


@dataclass(frozen=True)
class AdapterLoad:
    """ "Put adapter `name` (PEFT files in directory `path`, as the workers see it) into device
    slot `slot` before this step's forward pass". `version` tells apart two adapters loaded under
    one name at different times: a worker's host copy is keyed by (name, version, path)."""

    slot: int
    name: str
    path: str
    version: int


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seq_ids: I64  # [num_seqs]
    query_lens: I32  # [num_seqs] tokens fed this step
    context_lens: I32  # [num_seqs] tokens already in the KV cache
    input_ids: I32  # [sum(query_lens)]; DEFERRED_INPUT (only as a sequence's last fed token)
    # Ragged (common/block_tables.py): row i holds at least ceil((context_lens[i] + query_lens[i])
    # / block_size) blocks, the ones the sequence's tokens live in after this step.
    block_tables: BlockTables
    sample: U8  # [num_seqs] 1 where this step's last token yields a new sampled token
    sampling: SamplingBatch = field(default_factory=SamplingBatch.empty)
    # Block operations the worker applies before the forward pass, in this order: swap_out
    # (device -> host), swap_in (host -> device), copy (device -> device, copy-on-write).
    # Each is int32 [k, 2] of (src, dst) block ids. The scheduler never swaps in and out in the
    # same step, so a host block freed by a swap-in is never the target of a swap-out.
    swap_out: I32 = field(default_factory=no_block_ops)
    swap_in: I32 = field(default_factory=no_block_ops)
    copy: I32 = field(default_factory=no_block_ops)
    # LoRA: adapters loaded into device slots before the forward pass (after the block
    # operations), and the slot each sequence's tokens run through, -1 = the base model.
    # Empty lora_slots: every sequence runs the base model. A slot keeps its adapter across
    # steps (weights, like the model's) until a later load replaces it.
    adapter_loads: tuple[AdapterLoad, ...] = ()
    lora_slots: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    # Speculative decoding: the last draft_lens[i] tokens fed for sequence i are drafts to
    # verify (empty = none anywhere). Its logits at the d + 1 last positions decide how many
    # the model accepts (StepResult.num_accepted); the sampled token follows the accepted.
    draft_lens: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    # Draft-model speculation: after this step the worker's draft model proposes
    # propose_lens[i] tokens for sequence i (StepResult.draft_proposals), from the token it
    # samples; row i's blocks then reach propose_lens[i] positions past its fed tokens, which
    # the proposing writes the draft model's cache at (empty = none anywhere).
    propose_lens: I32 = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def validate(self) -> None:
        """Shape checks the worker runs on every decoded plan, before touching its cache."""
        n = self.num_seqs
        for name in ("query_lens", "context_lens", "sample"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"plan.{name} has shape {getattr(self, name).shape}, want ({n},)")
        self.block_tables.validate(n)
        if int(self.query_lens.sum()) != self.num_tokens:
            raise ValueError("plan.input_ids length differs from the sum of query_lens")
        if n and int(self.query_lens.min()) < 1:
            raise ValueError("plan.query_lens must be positive")
        for name in ("temperature", "top_p", "top_k", "seed", "output_position"):
            if getattr(self.sampling, name).shape != (n,):
                raise ValueError(f"plan.sampling.{name} must have one entry per sequence")
        for name in (
            "num_logprobs",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "prompt_logprobs",
            "prompt_next_token",
        ):
            if getattr(self.sampling, name).shape not in ((n,), (0,)):
                raise ValueError(f"plan.sampling.{name} must have one entry per sequence, or none")
        for prefix in ("bias", "history"):
            offsets = getattr(self.sampling, f"{prefix}_offsets")
            if offsets.size == 0:
                continue
            values = getattr(self.sampling, f"{prefix}_token_ids")
            if (
                offsets.shape != (n + 1,)
                or offsets[0] != 0
                or offsets[-1] != values.size
                or (np.diff(offsets) < 0).any()
            ):
                raise ValueError(
                    f"plan.sampling.{prefix}_offsets must be [num_seqs + 1] rising from 0 to the data length"
                )
        if self.sampling.bias_values.shape != self.sampling.bias_token_ids.shape:
            raise ValueError("plan.sampling.bias_values must match bias_token_ids")
        rows, masks = self.sampling.mask_rows, self.sampling.token_masks
        if rows.shape not in ((n,), (0,)) or masks.ndim != 2:
            raise ValueError("plan.sampling.mask_rows must have one entry per sequence, or none")
        if rows.size:
            # A sequence verifying d drafts has d + 1 masks from its mask row on: ordered by
            # their first rows, the sequences' spans must tile token_masks.
            at = np.flatnonzero(rows >= 0)
            widths = self.draft_lens[at] + 1 if self.draft_lens.shape == (n,) else np.ones(at.size, np.int64)
            order = np.argsort(rows[at], kind="stable")
            starts, ends = rows[at][order].astype(np.int64), (rows[at] + widths)[order]
            tiled = not starts.size or (starts[0] == 0 and (starts[1:] == ends[:-1]).all())
            if int(rows.min()) < -1 or not tiled or (int(ends[-1]) if ends.size else 0) != masks.shape[0]:
                raise ValueError(
                    "plan.sampling.mask_rows must cover the rows of token_masks once each "
                    "(a sequence with d drafts d + 1 of them), -1 elsewhere"
                )
            if not self.sample[rows >= 0].all():
                raise ValueError("plan.sampling.mask_rows constrains a sequence that samples nothing this step")
        for name in ("swap_out", "swap_in", "copy"):
            ops = getattr(self, name)
            if ops.ndim != 2 or ops.shape[1] != 2:
                raise ValueError(f"plan.{name} has shape {ops.shape}, want (k, 2)")
        if self.lora_slots.shape not in ((n,), (0,)):
            raise ValueError("plan.lora_slots must have one entry per sequence, or none")
        if self.lora_slots.size and int(self.lora_slots.min()) < -1:
            raise ValueError("plan.lora_slots holds a slot below -1")
        drafts = self.draft_lens
        if drafts.shape not in ((n,), (0,)):
            raise ValueError("plan.draft_lens must have one entry per sequence, or none")
        if drafts.size and (int(drafts.min()) < 0 or bool((drafts >= self.query_lens).any())):
            raise ValueError("plan.draft_lens must lie in [0, query_lens)")
        if drafts.size and not self.sample[drafts > 0].all():
            raise ValueError("plan.draft_lens: a sequence with drafts must sample")
        proposes = self.propose_lens
        if proposes.shape not in ((n,), (0,)):
            raise ValueError("plan.propose_lens must have one entry per sequence, or none")
        if proposes.size and (int(proposes.min()) < 0 or not self.sample[proposes > 0].all()):
            raise ValueError("plan.propose_lens must be >= 0, and a sequence with proposals must sample")
        loaded = [load.slot for load in self.adapter_loads]
        if any(slot < 0 for slot in loaded) or len(set(loaded)) != len(loaded):
            raise ValueError("plan.adapter_loads must name distinct slots >= 0")


@dataclass(frozen=True)
class StepResult:
    step_id: int
    # [num_seqs] the sampled token of each sequence, -1 where plan.sample is 0.
    sampled_token_ids: I32
    execute_seconds: float = 0.0
    # [num_seqs] log-probability of the sampled token under the model's unmodified distribution
    # (log_softmax of the raw logits); NaN where nothing was sampled. Empty when no row sampled.
    logprobs: F32 = field(default_factory=lambda: np.zeros(0, np.float32))
    # [num_seqs, K] the K = max(num_logprobs) most likely tokens and their log-probabilities,
    # best first; rows that asked for fewer are padded with -1 and -inf.
    top_token_ids: I32 = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    top_logprobs: F32 = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    # Prompt log-probabilities, ragged: sequence i's scored prompt tokens are entries
    # [o[i], o[i+1]) of the arrays below, in position order; o = prompt_offsets [num_seqs + 1]
    # (empty when no sequence asked). Top arrays are [entries, K], padded with -1 / -inf.
    prompt_offsets: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_logprobs: F32 = field(default_factory=lambda: np.zeros(0, np.float32))
    prompt_top_token_ids: I32 = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    prompt_top_logprobs: F32 = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    # Speculative decoding, when the plan has draft_lens: [num_seqs] drafts accepted, in order
    # (sampled_token_ids then holds the token after them), and float32 [sum(draft_lens)] the
    # log-probability of each draft token under the model's raw distribution at its position.
    num_accepted: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    draft_logprobs: F32 = field(default_factory=lambda: np.zeros(0, np.float32))
    # int32 [sum(plan.propose_lens)]: the draft model's proposals, plan.propose_lens[i] for
    # sequence i in order (the next step's drafts).
    draft_proposals: I32 = field(default_factory=lambda: np.zeros(0, np.int32))
    # Seconds of the step by part when the worker profiles its steps (worker_svc.step.step_profile);
    # empty otherwise.
    part_seconds: dict[str, float] = field(default_factory=dict)
