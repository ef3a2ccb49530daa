"""The scheduler's LoRA slots, driven by a fake stateless worker that keeps slots as a real one
does: it applies each plan's loads in plan order and runs every row through the adapter its
slot holds at that step. Its token depends on the position and on that adapter, so a row run
through the wrong slot, or a load planned against the worker's order, changes the output.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.plan import AdapterLoad, StepPlan, StepResult
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.lora.adapter_registry import Adapter
from scheduler_svc.sched.plan_builder import PlanBuilder
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import SamplingOptions, Sequence, SequenceStatus, StoppingParams
from scheduler_svc.sched.sequence_group import SequenceGroup

EOS = 2
Key = tuple[str, int]


def adapter(name: str, version: int = 1) -> Adapter:
    return Adapter(name, f"/adapters/{name}", version, 8, 2.0, ("q_proj", "v_proj"))


A, B, C = adapter("a"), adapter("b"), adapter("c")


def key(a: Adapter | None) -> Key | None:
    return None if a is None else (a.name, a.version)


def token(position: int, held: Key | None) -> int:
    shift = 0 if held is None else 100 * (ord(held[0][0]) - 96) + held[1]
    return 10 + (position * 7 + shift) % 1000


class SlotWorker:
    """Applies loads in plan order; checks each row's slot holds its group's adapter."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.held: dict[int, Key] = {}
        self.loads: list[AdapterLoad] = []
        self.groups: dict[int, SequenceGroup] = {}  # by seq id, filled by the test as it adds
        self.max_distinct = 0

    def execute(self, plan: StepPlan) -> StepResult:
        plan.validate()
        for load in plan.adapter_loads:
            assert 0 <= load.slot < self.num_slots, load
            self.held[load.slot] = (load.name, load.version)
            self.loads.append(load)
        slots = plan.lora_slots.tolist() if plan.lora_slots.size else [-1] * plan.num_seqs
        assert plan.lora_slots.size == 0 or any(s >= 0 for s in slots), "lora_slots without an adapted row"
        self.max_distinct = max(self.max_distinct, len({s for s in slots if s >= 0}))
        tokens = np.full(plan.num_seqs, -1, np.int32)
        for i, (seq_id, slot) in enumerate(zip(plan.seq_ids.tolist(), slots)):
            held = self.held[slot] if slot >= 0 else None
            group = self.groups[seq_id]
            assert held == key(group.adapter), f"step {plan.step_id}: seq {seq_id} ran through {held}"
            if plan.sample[i]:
                tokens[i] = token(int(plan.context_lens[i] + plan.query_lens[i]), held)
        return StepResult(plan.step_id, tokens)


def make_scheduler(num_slots: int = 2, num_blocks: int = 200, num_cpu_blocks: int = 64, **cfg: object) -> Scheduler:
    bm = BlockManager(num_blocks, 4, num_host_blocks=num_cpu_blocks, enable_prefix_caching=True)
    config = SchedulerConfig(**cfg)  # type: ignore[arg-type]
    return Scheduler(config, bm, 1024, frozenset({EOS}), block_bytes=1000, num_lora_slots=num_slots)


def add(
    s: Scheduler,
    worker: SlotWorker,
    rid: int,
    lora: Adapter | None,
    prompt: list[int] | None = None,
    max_tokens: int = 6,
    priority: int = 0,
) -> SequenceGroup:
    params = SamplingOptions()
    prompt = prompt if prompt is not None else [100 + rid * 50 + i for i in range(9)]
    seq = Sequence(s.queues.new_seq_id(), f"r{rid}", list(prompt), params, StoppingParams(max_tokens=max_tokens), rid)
    group = SequenceGroup(seq.request_id, [seq], params, rid, priority=priority, adapter=lora)
    s.add(group)
    worker.groups[seq.seq_id] = group
    return group


def step(s: Scheduler, worker: SlotWorker, in_flight: deque[StepPlan], pipelined: bool) -> bool:
    """Plan what can be planned, run the oldest plan; False when nothing ran."""
    while len(in_flight) < (2 if pipelined else 1):
        plan = s.schedule() if s.has_work else None
        if plan is None:
            break
        s.check_integrity()
        in_flight.append(plan)
    if not in_flight:
        return False
    plan = in_flight.popleft()
    s.update(plan, worker.execute(plan))
    s.check_integrity()
    return True


def drain(s: Scheduler, worker: SlotWorker, pipelined: bool = False) -> None:
    in_flight: deque[StepPlan] = deque()
    for _ in range(5000):
        if not step(s, worker, in_flight, pipelined) and not s.has_work:
            break
    assert not s.has_work and not in_flight
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert sum(s.queues.adapter_slots.refs) == 0


def expected(group: SequenceGroup) -> list[int]:
    seq = group.seqs[0]
    return [token(seq.num_prompt_tokens + i, key(group.adapter)) for i in range(seq.num_output_tokens)]


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize(("num_blocks", "mode"), [(400, "auto"), (20, "swap"), (20, "recompute")])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_base_and_three_adapters_over_two_slots(seed: int, num_blocks: int, mode: str, pipelined: bool) -> None:
    rng = random.Random(seed)
    s = make_scheduler(2, num_blocks, max_num_batched_tokens=32, max_num_seqs=6, preemption_mode=mode)
    worker = SlotWorker(2)
    arrivals = sorted((rng.randrange(40), rid) for rid in range(30))
    groups: list[SequenceGroup] = []
    in_flight: deque[StepPlan] = deque()
    for t in range(5000):
        while arrivals and arrivals[0][0] <= t:
            _, rid = arrivals.pop(0)
            lora = rng.choice([None, A, B, C])
            prompt = [rng.randrange(3, 900) for _ in range(rng.randrange(1, 20))]
            groups.append(add(s, worker, rid, lora, prompt, max_tokens=rng.randrange(1, 40)))
        ran = step(s, worker, in_flight, pipelined)
        if not ran and not arrivals and not s.has_work:
            break
    assert not s.has_work and not arrivals
    assert worker.max_distinct <= 2
    for group in groups:
        assert group.seqs[0].output_token_ids == expected(group), group.request_id
        assert group.seqs[0].num_output_tokens > 0
    assert s.num_adapter_loads == len(worker.loads) >= 3  # every load reached the worker
    if num_blocks == 20:
        assert s.queues.num_preemptions > 0  # the small pool did preempt
    assert s.block_manager.num_free_blocks == num_blocks


def test_grouped_arrivals_load_each_adapter_once() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    groups = [add(s, worker, rid, lora) for rid, lora in enumerate([A] * 4 + [B] * 4 + [C] * 4)]
    drain(s, worker)
    assert [(load.slot, load.name) for load in worker.loads] == [(0, "a"), (1, "b"), (0, "c")]
    assert s.num_adapter_loads == 3
    assert all(g.seqs[0].output_token_ids == expected(g) for g in groups)


def test_a_second_wave_of_a_resident_adapter_needs_no_load() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    add(s, worker, 0, A)
    drain(s, worker)
    add(s, worker, 1, A)
    add(s, worker, 2, None)
    drain(s, worker)
    assert s.num_adapter_loads == 1


def test_base_rows_carry_no_slots_and_mixed_rows_minus_one() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    add(s, worker, 0, None)
    plan = s.schedule()
    assert plan is not None and plan.lora_slots.size == 0 and plan.adapter_loads == ()
    s.update(plan, worker.execute(plan))
    add(s, worker, 1, B)
    plan = s.schedule()
    assert plan is not None
    assert plan.lora_slots.tolist() == [-1, 0] and plan.adapter_loads == (AdapterLoad(0, "b", "/adapters/b", 1),)
    s.update(plan, worker.execute(plan))
    plan = s.schedule()
    assert plan is not None and plan.lora_slots.tolist() == [-1, 0] and plan.adapter_loads == ()


def test_a_group_waiting_for_a_slot_is_overtaken_by_nobody() -> None:
    """Strict line order: the head waits for a slot, and the base request behind it waits too."""
    s = make_scheduler(1)
    worker = SlotWorker(1)
    a = add(s, worker, 0, A, max_tokens=5)
    b = add(s, worker, 1, B)
    base = add(s, worker, 2, None)
    in_flight: deque[StepPlan] = deque()
    while a.status is not SequenceStatus.FINISHED:
        assert b.status is SequenceStatus.WAITING and base.status is SequenceStatus.WAITING
        step(s, worker, in_flight, False)
    step(s, worker, in_flight, False)
    assert b.status is SequenceStatus.RUNNING and base.status is SequenceStatus.RUNNING
    drain(s, worker)


def test_priority_preempts_for_blocks_never_for_a_slot() -> None:
    s = make_scheduler(1)
    worker = SlotWorker(1)
    low = add(s, worker, 0, A, max_tokens=8, priority=5)
    step(s, worker, deque(), False)
    high = add(s, worker, 1, B, priority=0)
    in_flight: deque[StepPlan] = deque()
    step(s, worker, in_flight, False)
    assert low.status is SequenceStatus.RUNNING and high.status is SequenceStatus.WAITING
    assert s.queues.num_preemptions == 0
    drain(s, worker)
    assert high.seqs[0].output_token_ids == expected(high)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_releases_the_slot_and_resuming_reacquires_it(mode: str) -> None:
    # 8 blocks of 4: two groups of 9-token prompts take 3 blocks each, then grow into the rest.
    s = make_scheduler(2, num_blocks=8, preemption_mode=mode, watermark=0.0)
    worker = SlotWorker(2)
    first = add(s, worker, 0, A, max_tokens=12)
    second = add(s, worker, 1, B, max_tokens=12)
    in_flight: deque[StepPlan] = deque()
    while s.queues.num_preemptions == 0:
        assert step(s, worker, in_flight, False)
    want = SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING
    assert second.status is want and first.status is SequenceStatus.RUNNING
    assert s.queues.adapter_slots.refs == [1, 0]  # b's slot is idle, b still resident
    assert s.queues.adapter_slots.resident == {("a", 1): 0, ("b", 1): 1}
    drain(s, worker)
    assert s.num_adapter_loads == 2  # b came back to its idle slot without a load
    assert [g.seqs[0].output_token_ids == expected(g) for g in (first, second)] == [True, True]


def test_a_preempted_group_may_come_back_in_another_slot() -> None:
    s = make_scheduler(1, num_blocks=8, preemption_mode="recompute", watermark=0.0)
    worker = SlotWorker(1)
    first = add(s, worker, 0, A, max_tokens=12)
    second = add(s, worker, 1, A, max_tokens=12)
    third = add(s, worker, 2, A, max_tokens=12)
    drain(s, worker)
    assert s.queues.num_preemptions > 0 and s.num_adapter_loads == 1
    assert all(g.seqs[0].output_token_ids == expected(g) for g in (first, second, third))


def test_abort_frees_the_slot() -> None:
    s = make_scheduler(1)
    worker = SlotWorker(1)
    a = add(s, worker, 0, A, max_tokens=50)
    b = add(s, worker, 1, B)
    step(s, worker, deque(), False)
    assert s.queues.adapter_slots.refs == [1]
    s.abort(b.group_id)  # waiting: held nothing
    assert s.queues.adapter_slots.refs == [1]
    s.abort(a.group_id)
    assert s.queues.adapter_slots.refs == [0]
    s.check_integrity()
    c = add(s, worker, 2, C)
    drain(s, worker)
    assert c.seqs[0].output_token_ids == expected(c)
    assert [load.name for load in worker.loads] == ["a", "c"]


def test_a_load_planned_ahead_runs_after_the_plan_in_flight() -> None:
    """Plan N runs a's row in slot 0; a is aborted and c planned into slot 0 before N's result.
    The worker applies N+1's load after N's forward, so N's row still ran through a."""
    s = make_scheduler(1)
    worker = SlotWorker(1)
    a = add(s, worker, 0, A, max_tokens=50)
    s.update(first := s.schedule(), worker.execute(first))  # type: ignore[arg-type]
    in_flight = s.schedule()
    assert in_flight is not None and in_flight.lora_slots.tolist() == [0]
    s.abort(a.group_id)
    c = add(s, worker, 1, C)
    ahead = s.schedule()
    assert ahead is not None and s.num_planned_ahead == 1
    assert ahead.adapter_loads == (AdapterLoad(0, "c", "/adapters/c", 1),) and ahead.lora_slots.tolist() == [0]
    assert s.update(in_flight, worker.execute(in_flight)) == []  # a's row: ran through a, skipped
    s.update(ahead, worker.execute(ahead))
    drain(s, worker)
    assert c.seqs[0].output_token_ids == expected(c)


def test_plain_adapter_decodes_are_planned_ahead() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    groups = [add(s, worker, rid, lora, max_tokens=20) for rid, lora in enumerate([A, B, None, A])]
    drain(s, worker, pipelined=True)
    assert s.num_planned_ahead > 10
    assert all(g.seqs[0].output_token_ids == expected(g) for g in groups)


def test_prefix_cache_is_shared_within_an_adapter_never_across() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    prompt = list(range(200, 221))  # 5 full blocks of 4 before the last token
    first = add(s, worker, 0, A, prompt)
    drain(s, worker)
    same = add(s, worker, 1, A, prompt)
    other = add(s, worker, 2, B, prompt)
    base = add(s, worker, 3, None, prompt)
    plan = s.schedule()
    assert plan is not None
    assert same.prefix_hit_tokens == 20 and other.prefix_hit_tokens == 0 and base.prefix_hit_tokens == 0
    tables = [set(s.block_manager.block_table(g.seqs[0].seq_id)) for g in (same, other, base)]
    assert not tables[0] & tables[1] and not tables[0] & tables[2] and not tables[1] & tables[2]
    s.update(plan, worker.execute(plan))
    drain(s, worker)
    for g in (first, same, other, base):
        assert g.seqs[0].output_token_ids == expected(g)


def test_a_reregistered_adapter_does_not_hit_its_predecessors_cache() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    prompt = list(range(300, 321))
    add(s, worker, 0, adapter("a", 1), prompt)
    drain(s, worker)
    again = add(s, worker, 1, adapter("a", 2), prompt)
    drain(s, worker)
    assert again.prefix_hit_tokens == 0 and s.num_adapter_loads == 2


def test_router_and_queue_estimates_use_the_adapters_chain() -> None:
    from scheduler_svc.kv.prefix_chain import extend_chain

    salted: list[int] = []
    plain: list[int] = []
    extend_chain(salted, list(range(16)), 4, 4, A.cache_salt)
    extend_chain(plain, list(range(16)), 4, 4)
    assert not set(salted) & set(plain)
    s = make_scheduler(2)
    worker = SlotWorker(2)
    add(s, worker, 0, A, list(range(17)))
    drain(s, worker)
    bm = s.block_manager
    assert bm.cached_prefix_blocks(salted) == 4 and bm.cached_prefix_blocks(plain) == 0


def test_adapter_groups_need_slots() -> None:
    s = make_scheduler(0)
    with pytest.raises(ValueError, match="no LoRA slots"):
        add(s, SlotWorker(0), 0, A)
    assert not s.has_work


def test_evacuate_forgets_the_slots_and_the_next_scheduler_loads_again() -> None:
    s = make_scheduler(2)
    worker = SlotWorker(2)
    group = add(s, worker, 0, A, max_tokens=10)
    step(s, worker, deque(), False)
    assert s.evacuate() == [group]
    assert s.queues.adapter_slots.refs == [0, 0] and s.queues.adapter_slots.resident == {}
    s.check_integrity()
    other = make_scheduler(2)
    fresh = SlotWorker(2)
    other.add(group)
    fresh.groups[group.seqs[0].seq_id] = group
    drain(other, fresh)
    assert [load.name for load in fresh.loads] == ["a"]
    assert group.seqs[0].output_token_ids == expected(group)


def test_the_builder_sees_a_slot_change_under_the_same_rows() -> None:
    """Rows' slots are cached with the other static fields; a load or reset must refresh them."""
    s = make_scheduler(2)
    bm, slots = s.block_manager, s.queues.adapter_slots
    params = SamplingOptions()
    seq = Sequence(0, "r0", [5, 6, 7], params, StoppingParams(max_tokens=4), 0)
    group = SequenceGroup("r0", [seq], params, 0, adapter=B)
    builder = PlanBuilder(bm, slots, {group.group_id: group})
    bm.allocate(0, 3, 0)
    slots.acquire(B)
    assert builder.build(0, [seq], [3]).lora_slots.tolist() == [0]
    slots.reset()  # as after a lost worker group: b may come back elsewhere
    slots.acquire(A)
    slots.acquire(B)
    assert builder.build(1, [seq], [3]).lora_slots.tolist() == [1]
