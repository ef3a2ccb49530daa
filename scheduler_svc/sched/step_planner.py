"""Which sequences run in the next step, and how many tokens each feeds.

Each step, under a token budget:

  1. Running groups in line order feed what they lack: first every decode (1 token per
     sequence), then the prompt chunks, so a long prompt prefilled over many steps never
     holds back a decode. When blocks run short, the group last in line is preempted (swap
     or recompute, see `preemption.py`) until the current group fits, or it is the victim
     itself; a group already in the step is never the victim (a chunk short of blocks then
     waits).
  2. Unless step 1 preempted something, the heads of swapped and waiting are resumed or
     admitted in line order (so a swapped group comes back before any later arrival), as long
     as the budget, `max_num_seqs`, the free blocks above a watermark and the LoRA slots allow
     (a group whose adapter has no slot waits until a slot's running groups all stop). New
     prompts start from their longest prefix-cache hit (of their adapter's chain). Admission
     stops at the first group that does not fit: nobody is overtaken, so nobody starves, and
     no more than the worker's slot count of adapters ever share a step. Priority preemption
     (3.) weighs blocks only: it never evicts for a slot.
  3. Before either, a waiting or swapped group of strictly higher priority than the last
     running one, that does not fit, preempts running groups of lower priority until it fits.
     This runs first so that no group is preempted after its rows were planned: every
     swap-out of a step then precedes every swap-in, the order the worker applies them in.

Samples fork just before their last prompt token (each then draws its first token from its
own logits row); beams sample all together or not at all.

Micro-batches (a pipelined worker group with several plans in flight): a group in a plan in
flight (`busy`) is neither planned again nor preempted until that plan's result is applied,
and `max_rows` caps the idle running sequences a plan takes so that the plans still to come
get their share. A group short of blocks whose victim (the last running group) is busy waits
for a plan in which it is not: the victim is still always the last in line.
"""

from __future__ import annotations

from common.config import SchedulerConfig
from scheduler_svc.sched.drafter import Drafter
from scheduler_svc.sched.queues import Queues
from scheduler_svc.sched.sequence import Sequence, SequenceStatus
from scheduler_svc.sched.sequence_group import SequenceGroup


class StepPlanner:
    """Decides; `Queues` owns the queues and counters and changes them through its verbs
    (`preempt`, `fork`, `resume`), which the planner calls. The planner writes only block
    allocations and the sequences' progress of the step it plans."""

    def __init__(self, queues: Queues, config: SchedulerConfig, drafter: Drafter | None = None) -> None:
        self.queues = queues
        self.config = config
        self.drafter = drafter
        self.bm = queues.block_manager
        self.watermark_blocks = int(config.watermark * self.bm.num_blocks)

    def pick(
        self, step_id: int, busy: frozenset[int] = frozenset(), max_rows: int | None = None
    ) -> tuple[list[Sequence], list[int]]:
        """Step `step_id`'s rows and how many tokens each feeds; `busy`: ids of groups in a plan
        in flight, `max_rows`: the most sequences of running groups it takes (micro-batches)."""
        bm = self.bm
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        query_lens: list[int] = []
        self._preempt_for_priority(budget, step_id, busy)
        preempted = False
        running = self.queues.running
        tables, ref, bs = bm.tables, bm.device.ref, bm.block_size
        # Decodes first, prompt chunks after them: a long prompt being prefilled chunk by chunk
        # takes what budget the running decodes leave, never their tokens (they would stall
        # for every chunk of it otherwise).
        chunks: list[SequenceGroup] = []
        taken: set[int] = set()
        drafter = self.drafter
        if drafter is not None and len(running) > drafter.config.disable_by_batch_size:
            drafter = None  # a batch this large is bound by compute: verifying costs more than it saves
        for phase in (running, chunks):
            i = 0
            while i < len(phase) and budget > 0:
                group = phase[i]
                i += 1
                if busy and group.group_id in busy:
                    continue
                if max_rows is not None and len(seqs) >= max_rows:
                    break
                if group.width == 1:
                    # Fast path, most rows of most steps: a decode whose token lands in a block the
                    # sequence already owns alone needs no allocation and no check (inlined: this
                    # runs for every decoding sequence of every step).
                    seq = group.seqs[0]
                    c = seq.num_computed_tokens
                    if len(seq.token_ids) + seq.pending - c == 1:
                        if drafter is not None and not seq.pending and self._draft(drafter, seq, budget):
                            seqs.append(seq)
                            query_lens.append(1 + len(seq.draft))
                            budget -= 1 + len(seq.draft)
                            taken.add(group.group_id)
                            continue
                        table = tables[seq.seq_id]
                        k = c // bs
                        if k < len(table) and ref[table[k]] == 1:
                            seqs.append(seq)
                            query_lens.append(1)
                            budget -= 1
                            taken.add(group.group_id)
                            continue
                if phase is running and _chunked(group):
                    chunks.append(group)
                    continue
                if group.status is not SequenceStatus.RUNNING:
                    continue  # preempted by a decode before its turn
                rows = self._rows(group, budget)
                need = self._blocks_needed(rows)
                while need > bm.num_free_blocks:
                    victim = running[-1]
                    if victim.group_id in busy or victim.group_id in taken:
                        break
                    self.queues.preempt(victim, step_id)
                    preempted = True
                    if victim is group:
                        break
                if group.status is not SequenceStatus.RUNNING:
                    break
                if need > bm.num_free_blocks:
                    continue  # its victim is in a plan in flight or this one: a later plan takes it
                budget -= self._take(rows, seqs, query_lens)
                taken.add(group.group_id)
        # A step that had to preempt admits nothing, unless nothing else would run at all.
        if not preempted or not seqs:
            self._admit(budget, seqs, query_lens, step_id)
        if drafter is not None and drafter.config.method == "draft":
            self._lookahead(drafter, seqs, query_lens)
        return seqs, query_lens

    def _draft(self, drafter: Drafter, seq: Sequence, budget: int) -> bool:
        """Give a decoding sequence its draft tokens and their blocks; False (nothing changed)
        when it drafts none or its blocks would not fit: it then decodes one token as usual."""
        draft = drafter.propose(seq, budget)
        if draft and seq.grammar is not None:  # verification samples each position under its mask
            draft = draft[: seq.grammar.allowed_prefix(draft)]
        end = seq.num_computed_tokens + 1 + len(draft)
        if not draft or not self.bm.can_allocate(seq.seq_id, end, seq.num_computed_tokens):
            return False
        self.bm.allocate(seq.seq_id, end, seq.num_computed_tokens)
        seq.draft = draft
        return True

    def _lookahead(self, drafter: Drafter, seqs: list[Sequence], query_lens: list[int]) -> None:
        """A draft model proposes after the step for each row that samples and may draft: its
        blocks then reach as far as the proposing writes the draft model's cache. Where they
        do not fit, the row proposes nothing (no preemption for drafts)."""
        bm = self.bm
        for seq, q in zip(seqs, query_lens):
            c = seq.num_computed_tokens
            end = c + q
            if seq.pending or end != len(seq.token_ids) + len(seq.draft):
                continue  # a prompt chunk before its last, or a row behind a token in flight
            k = drafter.lookahead(seq, end)
            if k and bm.can_allocate(seq.seq_id, end + k, c):
                bm.allocate(seq.seq_id, end + k, c)
                seq.propose = k

    def _take(self, rows: list[tuple[Sequence, int]], seqs: list[Sequence], query_lens: list[int]) -> int:
        """Allocate the rows' blocks and add them to the step; returns the tokens they feed."""
        bm = self.bm
        used = 0
        for seq, q in rows:
            bm.allocate(seq.seq_id, seq.num_computed_tokens + q, seq.num_computed_tokens)
            seqs.append(seq)
            query_lens.append(q)
            used += q
        return used

    def _blocks_needed(self, rows: list[tuple[Sequence, int]]) -> int:
        """An upper bound: forks sharing one block count its copy once each."""
        bm = self.bm
        return sum(bm.blocks_needed(s.seq_id, s.num_computed_tokens + q, s.num_computed_tokens) for s, q in rows)

    def _rows(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """What each of the group's sequences feeds this step, within `budget` tokens."""
        if group.needs_fork and group.seqs[0].num_tokens - group.seqs[0].num_computed_tokens == 1:
            self._fork_samples(group)
        rows: list[tuple[Sequence, int]] = []
        complete = True
        live = group.live()
        for seq in live:
            if seq is not live[0] and not self.bm.has_table(seq.seq_id):
                # Recomputing a forked group: the first sequence recomputes the shared prompt
                # alone; the others then share its blocks and compute only their own tails.
                if not self._share_leader_prefix(group, live[0], seq):
                    complete = False
                    continue
            left = seq.num_tokens + seq.pending - seq.num_computed_tokens
            q = min(left, budget)
            if group.needs_fork:
                q = min(q, left - 1)  # stop before the last prompt token: the fork happens there
            complete = complete and q == left
            if q > 0:
                rows.append((seq, q))
                budget -= q
        if group.is_beam and not complete:
            # Beams sample together or not at all: cap each below its last token until every
            # beam's catch-up (after a recompute) fits one step.
            capped = [(s, min(q, s.num_tokens - s.num_computed_tokens - 1)) for s, q in rows]
            rows = [(s, q) for s, q in capped if q > 0]
        return rows

    def _share_leader_prefix(self, group: SequenceGroup, leader: Sequence, seq: Sequence) -> bool:
        shared = group.shared_prompt_blocks(self.bm.block_size)
        if leader.num_computed_tokens < shared * self.bm.block_size:
            return False
        self.bm.share_prefix(leader.seq_id, seq.seq_id, shared)
        seq.num_computed_tokens = shared * self.bm.block_size
        return True

    def _fork_samples(self, group: SequenceGroup) -> None:
        parent = group.seqs[0]
        for index in range(1, group.sampling.best_of):
            self.queues.fork(parent, index, group.sampling.sample_seed(index))
        group.forked = True

    def _admission_need(self, group: SequenceGroup, budget: int) -> int:
        """Free blocks resuming or admitting `group` takes this step, at most."""
        bm = self.bm
        live = group.live()
        if group.status is SequenceStatus.SWAPPED:
            # Its blocks, plus what its rows of this step add (at least one per sequence, so
            # its next tokens do not evict it again at once).
            need = len(bm.unique_blocks([s.seq_id for s in live], host=True))
            for seq in live:
                q = min(seq.num_tokens - seq.num_computed_tokens, budget)
                need += max(1, bm.blocks_for(seq.num_computed_tokens + q) - len(bm.host_table(seq.seq_id)))
            return need
        need = 0
        if len(live) > 1:
            # A recomputed forked group: the others' own tails, beyond the shared prompt.
            shared = group.shared_prompt_blocks(bm.block_size)
            need += sum(bm.blocks_for(s.num_tokens) - shared for s in live[1:])
            live = live[:1]
        for seq in live:
            hit = (
                []
                if seq.sampling.prompt_logprobs is not None
                else bm.prefix_hit(seq.seq_id, seq.token_ids, group.cache_salt)
            )
            start = len(hit) * bm.block_size
            left = seq.num_tokens - start
            q = min(left, budget)
            if group.needs_fork:
                # Forking now: every sample may write its last prompt token into a block of its own.
                q, extra = (1, group.sampling.best_of - 1) if left == 1 else (min(q, left - 1), 0)
                need += extra
            need += bm.admission_cost(hit, start + q)
            budget -= q
        return need

    def _fits(self, group: SequenceGroup, budget: int, reserve: int = 0) -> bool:
        if group.adapter is not None and not self.queues.adapter_slots.can_acquire(group.adapter):
            return False  # every LoRA slot runs another adapter: wait for one to go idle
        return self._fits_blocks(group, budget, reserve)

    def _fits_blocks(self, group: SequenceGroup, budget: int, reserve: int = 0) -> bool:
        """Whether the group's sequences and blocks fit, whatever its LoRA slot."""
        if self.queues.running_slots + group.width > self.config.max_num_seqs:
            return False
        reserve += self.watermark_blocks if self.queues.running else 0
        return self._admission_need(group, budget) + reserve <= self.bm.num_free_blocks

    def running_need(self, budget: int | None = None) -> int:
        """Blocks the running groups take this step, at most (read-only, unlike `_rows`)."""
        bm = self.bm
        budget = self.config.max_num_batched_tokens if budget is None else budget
        tables, ref, bs = bm.tables, bm.device.ref, bm.block_size
        need = 0
        for group in self.queues.running:
            if group.width == 1:
                # pick()'s fast path: a decode into a block the sequence owns alone takes none.
                seq = group.seqs[0]
                c = seq.num_computed_tokens
                if len(seq.token_ids) + seq.pending - c == 1:
                    table = tables[seq.seq_id]
                    k = c // bs
                    if k < len(table) and ref[table[k]] == 1:
                        continue
            for seq in group.live():
                c = seq.num_computed_tokens
                q = min(seq.num_tokens + seq.pending - c, budget)
                need += bm.blocks_needed(seq.seq_id, c + q, c)
        return need

    def _preempt_for_priority(self, budget: int, step_id: int, busy: frozenset[int]) -> None:
        queues = self.queues
        head = queues.head()
        while (
            head is not None
            and queues.running
            and queues.running[-1].group_id not in busy
            and queues.running[-1].priority > head.priority
            # Blocks only: a head short of a LoRA slot waits for one (see the module docstring).
            and not self._fits_blocks(head, budget, reserve=self.running_need(budget))
        ):
            queues.preempt(queues.running[-1], step_id)

    def _admit(self, budget: int, seqs: list[Sequence], query_lens: list[int], step_id: int) -> None:
        bm = self.bm
        while budget > 0:
            group = self.queues.head()
            if group is None or group.preempted_step == step_id or not self._fits(group, budget):
                # A group that gave its blocks back in this step does not take them back in it.
                return
            self.queues.resume(group)
            rows = self._rows(group, budget)
            if self._blocks_needed(rows) <= bm.num_free_blocks:
                budget -= self._take(rows, seqs, query_lens)


def _chunked(group: SequenceGroup) -> bool:
    """Whether a sequence of the group feeds more than one token (a prompt, its next chunk, or
    a recompute's catch-up) rather than decoding."""
    return any(s.num_tokens + s.pending - s.num_computed_tokens > 1 for s in group.live())
