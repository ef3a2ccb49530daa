"""A step's result applied to its sequences: caches advanced, tokens appended, stop and
length rules, grammars, beam steps; what changed comes back as `TokenEvent`s.

The Scheduler calls this from `update` (pure and synchronous like it); the engine turns the
events into stream messages (`engine/step_reporter.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from common.plan import StepPlan, StepResult
from scheduler_svc.sched.drafter import Drafter
from scheduler_svc.sched.queues import Queues
from scheduler_svc.sched.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.sched.sequence_group import SequenceGroup


class TokenEvent(NamedTuple):
    """A token appended to `seq` this step; `finish_reason` is set if it ended the sequence.

    Beams report no tokens: their group's end is a single event with token_id -1.
    """

    group: SequenceGroup
    seq: Sequence
    token_id: int
    logprob: float
    finish_reason: FinishReason | None
    group_finished: bool
    # (token, logprob) of the most likely tokens, when the request asked for logprobs.
    top: tuple[tuple[int, float], ...] = ()
    # The sequence's length with this token, where a step appended several (kept drafts): a
    # stop string found at this token cuts the ones after it.
    length: int = -1


class ResultApplier:
    def __init__(self, queues: Queues, eos_token_ids: frozenset[int], drafter: Drafter | None = None) -> None:
        self.queues = queues
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter

    def apply(
        self, seqs: list[Sequence], plan: StepPlan, result: StepResult, advanced: bool, pending_rows: list[int]
    ) -> list[TokenEvent]:
        """Apply `result` of `plan` to its rows `seqs`. With `advanced`, the rows' computed
        tokens were counted when the next plan was planned ahead, and `pending_rows` are those
        whose sampled token the next plan feeds as a deferred input."""
        bm = self.queues.block_manager
        bs = bm.block_size
        events: list[TokenEvent] = []
        query_lens = plan.query_lens.tolist()
        context_lens = plan.context_lens.tolist()
        pending = set(pending_rows)
        sample = plan.sample.tolist()
        sampled = result.sampled_token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs.shape[0] == len(seqs) else [0.0] * len(seqs)
        beam_rows: dict[SequenceGroup, list[int]] = {}
        has_top = result.top_token_ids.shape[0] == len(seqs)
        running = SequenceStatus.RUNNING
        groups = self.queues.groups
        if result.prompt_offsets.size:
            self._collect_prompt_logprobs(seqs, plan, result)
        drafted = result.num_accepted.size > 0
        if drafted:
            accepted = result.num_accepted.tolist()
            draft_at = np.concatenate([[0], np.cumsum(plan.draft_lens)]).tolist()
            draft_lps = result.draft_logprobs.tolist()
        for i, seq in enumerate(seqs):
            if seq.status is not running:
                continue
            group = groups[seq.group_id]
            c = context_lens[i]
            if drafted and seq.draft:
                lps = draft_lps[draft_at[i] : draft_at[i] + accepted[i]]
                events.extend(self._apply_drafted(seq, group, c, sampled[i], logprobs[i], accepted[i], lps))
                continue
            e = c + query_lens[i]
            if not advanced:  # else counted when the next plan was planned ahead
                seq.num_computed_tokens = e
            if e // bs != c // bs:  # a block filled up: index it
                bm.commit(seq.seq_id, seq.token_ids, e, group.cache_salt)
            if not sample[i]:
                continue
            if i in pending:
                seq.pending -= 1
            if seq.sampling.beam_width > 1:
                beam_rows.setdefault(group, []).append(i)
                continue
            token, logprob = sampled[i], logprobs[i]
            if seq.grammar is not None and not seq.grammar.accept(token):
                events.append(self._refused(group, seq))
                continue
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
            k = seq.sampling.logprobs
            top = (
                tuple(zip(result.top_token_ids[i, :k].tolist(), result.top_logprobs[i, :k].tolist()))
                if k and has_top
                else ()
            )
            # The common case, a token that neither stops nor reaches a limit, costs one set
            # lookup and one comparison; the rules themselves are Sequence.end_reason.
            reason = (
                seq.end_reason(token)
                if token in seq.stop_ids or len(seq.token_ids) >= seq.token_limit or seq.grammar is not None
                else None
            )
            if reason is None:
                events.append(TokenEvent(group, seq, token, logprob, None, False, top))
                continue
            ended = self.queues.finish_seq(seq.seq_id, reason)
            events.append(TokenEvent(group, seq, token, logprob, reason, ended, top))
        for group, rows in beam_rows.items():
            events.extend(self._beam_step(group, [seqs[i] for i in rows], result, rows))
        if plan.propose_lens.size:
            self._take_proposals(seqs, plan, result)
        return events

    def _take_proposals(self, seqs: list[Sequence], plan: StepPlan, result: StepResult) -> None:
        """The draft model's proposals, kept for the next step's drafts; the blocks the proposing
        wrote past each sequence's tokens go back (the next step takes what it verifies)."""
        bm = self.queues.block_manager
        proposals = result.draft_proposals.tolist()
        at = 0
        for seq, n in zip(seqs, plan.propose_lens.tolist()):
            if not n:
                continue
            tokens, at = proposals[at : at + n], at + n
            seq.propose = 0
            if seq.status is SequenceStatus.RUNNING and self.drafter is not None:
                bm.trim(seq.seq_id, bm.blocks_for(seq.num_computed_tokens))
                self.drafter.proposed(seq, tokens)

    def _apply_drafted(
        self, seq: Sequence, group: SequenceGroup, c: int, token: int, logprob: float, accepted: int, lps: list[float]
    ) -> list[TokenEvent]:
        """A row that fed [last token, drafts]: the kept drafts, then the sampled token, each
        through the stop and length rules (a stop ends it there); the blocks reserved for the
        rejected drafts go back."""
        bm = self.queues.block_manager
        kept, drafted = seq.draft[:accepted], len(seq.draft)
        seq.draft = []
        if self.drafter is not None:
            self.drafter.record(seq, drafted, accepted)
        seq.num_computed_tokens = e = c + 1 + accepted
        bm.trim(seq.seq_id, bm.blocks_for(e))
        events: list[TokenEvent] = []
        for t, lp in zip([*kept, token], [*lps, logprob]):
            if seq.grammar is not None and not seq.grammar.accept(t):  # drafts were cut and masked alike
                events.append(self._refused(group, seq))
                return events
            seq.token_ids.append(t)
            seq.cumulative_logprob += lp
            limit = t in seq.stop_ids or len(seq.token_ids) >= seq.token_limit or seq.grammar is not None
            reason = seq.end_reason(t) if limit else None
            if reason is not None:
                ended = self.queues.finish_seq(seq.seq_id, reason)
                events.append(TokenEvent(group, seq, t, lp, reason, ended, length=len(seq.token_ids)))
                return events
            events.append(TokenEvent(group, seq, t, lp, None, False, length=len(seq.token_ids)))
        if e // bm.block_size != c // bm.block_size:
            bm.commit(seq.seq_id, seq.token_ids, e, group.cache_salt)
        return events

    def _refused(self, group: SequenceGroup, seq: Sequence) -> TokenEvent:
        """A token the sequence's grammar refuses, though the worker applied its mask: either
        the mask allowed no token (a grammar this vocabulary cannot spell) or the worker is
        broken. The output cannot go on, and the token is not the client's to see: an event
        without one."""
        ended = self.queues.finish_seq(seq.seq_id, FinishReason.ABORTED)
        return TokenEvent(group, seq, -1, 0.0, FinishReason.ABORTED, ended)

    def _collect_prompt_logprobs(self, seqs: list[Sequence], plan: StepPlan, result: StepResult) -> None:
        """Append the scores of prompt positions the group still lacks, in order; entry k of a
        row scores the token at position context + 1 + k, which may lie past the prompt. Runs
        before the step's tokens are applied: a group that ends on them still gets its scores."""
        offsets = result.prompt_offsets
        for i, seq in enumerate(seqs):
            begin, end = int(offsets[i]), int(offsets[i + 1])
            group = self.queues.groups.get(seq.group_id)
            if begin == end or group is None:
                continue
            store, prompt = group.prompt_logprobs, seq.prompt_token_ids
            first_target = int(plan.context_lens[i]) + 1
            for k in range(begin, end):
                target = first_target + (k - begin)
                if target != len(store) + 1 or target >= len(prompt):
                    continue
                ids, lps = result.prompt_top_token_ids[k], result.prompt_top_logprobs[k]
                top = tuple((int(t), float(v)) for t, v in zip(ids, lps) if t >= 0)
                store.append((prompt[target], float(result.prompt_logprobs[k]), top))

    def _beam_step(
        self, group: SequenceGroup, beams: list[Sequence], result: StepResult, rows: list[int]
    ) -> list[TokenEvent]:
        assert group.beam is not None
        stop_ids = set(beams[0].stopping.stop_token_ids)
        if not beams[0].stopping.ignore_eos:
            stop_ids |= self.eos_token_ids
        ends = [b.end_reason(ahead=1) for b in beams]
        choice = group.beam.step(
            beams, result.top_token_ids[rows], result.top_logprobs[rows], ends, frozenset(stop_ids)
        )
        if choice.done:
            for seq in group.live():
                self.queues.end_seq(seq, FinishReason.ABORTED)
            self.queues.end_group(group)
            return [TokenEvent(group, group.seqs[0], -1, 0.0, None, True)]
        chosen: dict[Sequence, list[tuple[int, float]]] = {}
        for parent, token, score in choice.beams:
            chosen.setdefault(parent, []).append((token, score))
        for beam in beams:
            if beam not in chosen:
                self.queues.end_seq(beam, FinishReason.ABORTED)
                group.seqs.remove(beam)
        for parent, picks in chosen.items():
            for token, score in picks[1:]:
                child = self.queues.fork(parent, parent.index, parent.seed or 0)
                child.token_ids.append(token)
                child.cumulative_logprob = score
            parent.token_ids.append(picks[0][0])
            parent.cumulative_logprob = picks[0][1]
        return []
