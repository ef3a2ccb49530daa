"""LoRA in the scheduler: slots refcounted by running groups and refilled least recently used,
at most as many adapters per step as slots, loads carried by the plans, preemption giving slots
back, the prefix cache kept apart per adapter; and the registry's refusals of bad adapter files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import AlreadyExists, InvalidArgument, NotFound
from common.plan import StepPlan
from scheduler_svc.adapter_slots import AdapterSlots
from scheduler_svc.adapters import Adapter, AdapterRegistry
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence_group import SequenceGroup
from tests.adapters import make_peft_adapter
from tests.test_scheduler import drive, make_scheduler, make_seq

A, B, C = (Adapter(n, f"/adapters/{n}", v, 8, 2.0, ("q_proj",)) for v, n in enumerate("abc", start=1))


def lora_scheduler(num_slots: int = 2, **kw: object) -> Scheduler:
    s = make_scheduler(**kw)  # type: ignore[arg-type]
    s.adapter_slots = AdapterSlots(num_slots)
    s._builder.slots = s.adapter_slots  # noqa: SLF001 (as the constructor wires them)
    return s


def add(s: Scheduler, seq_id: int, adapter: Adapter | None, prompt_len: int = 6, max_tokens: int = 4) -> SequenceGroup:
    seq = make_seq(seq_id, prompt_len, max_tokens)
    group = SequenceGroup(seq.request_id, [seq], seq.sampling, seq.arrival, adapter=adapter)
    s.add(group)
    return group


def replay(plans: list[StepPlan], adapters: dict[int, Adapter | None]) -> None:
    """Every row runs through a slot holding its group's adapter, as the worker would see it."""
    held: dict[int, str] = {}
    for plan in plans:
        for load in plan.adapter_loads:
            held[load.slot] = load.name
        slots = plan.lora_slots.tolist() if plan.lora_slots.size else [-1] * plan.num_seqs
        assert len({s for s in slots if s >= 0}) <= 2
        for seq_id, slot in zip(plan.seq_ids.tolist(), slots):
            adapter = adapters[seq_id]
            if adapter is None:
                assert slot == -1
            else:
                assert held.get(slot) == adapter.name, f"step {plan.step_id}: seq {seq_id} in slot {slot}"


def test_slots_are_refcounted_and_refilled_least_recently_released() -> None:
    slots = AdapterSlots(2)
    assert slots.acquire(A) == 0 and slots.acquire(B) == 1 and slots.acquire(A) == 0
    assert not slots.can_acquire(C)  # both slots referenced: C waits
    assert [load.name for load in slots.take_loads()] == ["a", "b"]
    slots.release(B)
    assert slots.can_acquire(C) and slots.acquire(C) == 1  # B's slot, the only idle one
    slots.release(A)
    slots.release(A)
    slots.release(C)
    assert slots.acquire(C) == 1 and slots.num_loads == 3  # still resident: no load
    assert slots.acquire(B) == 0  # A's slot (released before C's)
    assert [(load.slot, load.name) for load in slots.take_loads()] == [(1, "c"), (0, "b")]
    slots.check_integrity({("c", 3): 1, ("b", 2): 1})
    with pytest.raises(AssertionError):
        slots.check_integrity({("c", 3): 2, ("b", 2): 1})


def test_grouped_adapters_over_two_slots_load_each_once_and_never_share_a_step_three_ways() -> None:
    s = lora_scheduler(num_slots=2)
    adapters: dict[int, Adapter | None] = {}
    seq_id = 0
    for adapter in (A, B, C, None):
        for _ in range(4):
            add(s, seq_id, adapter)
            adapters[seq_id] = adapter
            seq_id += 1
    plans = drive(s)
    replay(plans, adapters)
    assert s.num_adapter_loads == 3  # no thrash: C takes the slot A's groups left, once
    assert not any(s.adapter_slots.refs)


def test_preempted_groups_give_their_slot_back_and_take_it_again() -> None:
    s = lora_scheduler(num_slots=2, num_blocks=12, block_size=4, num_cpu_blocks=4)
    adapters: dict[int, Adapter | None] = {}
    for i, adapter in enumerate((A, B, A, None, B, A)):
        add(s, i, adapter, prompt_len=7, max_tokens=12)
        adapters[i] = adapter
    plans = drive(s)
    assert s.num_preemptions > 0  # the pool is too small for all six: the scenario preempts
    replay(plans, adapters)
    assert not any(s.adapter_slots.refs)


def test_the_prefix_cache_is_shared_within_an_adapter_only() -> None:
    s = lora_scheduler(num_slots=2)
    prompt = 13  # three full blocks of 4, then the last token
    first = add(s, 0, A, prompt_len=prompt)
    drive(s)
    assert first.prefix_hit_tokens == 0
    for seq_id, adapter, hit in ((1, None, 0), (2, B, 0), (3, A, 12)):
        group = SequenceGroup(
            f"r{seq_id}", [make_seq(0, prompt)], make_seq(0, prompt).sampling, seq_id, adapter=adapter
        )
        group.seqs[0].seq_id = 100 + seq_id  # same tokens as the first request, a new sequence
        group.group_id = group.seqs[0].seq_id
        s.add(group)
        drive(s)
        assert group.prefix_hit_tokens == hit, f"adapter {adapter.name if adapter else 'base'}"


def test_a_group_with_an_adapter_needs_slots() -> None:
    with pytest.raises(ValueError, match="no LoRA slots"):
        add(make_scheduler(), 0, A)


@pytest.fixture(scope="module")
def good(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("registry") / "good", ("q_proj", "down_proj"))


def _variant(good: Path, out: Path, **config: object) -> Path:
    out.mkdir()
    data = json.loads((good / "adapter_config.json").read_text())
    data.update(config)
    (out / "adapter_config.json").write_text(json.dumps(data))
    (out / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    return out


def test_the_registry_loads_lists_and_unloads(tiny_model_dir: Path, good: Path) -> None:
    registry = AdapterRegistry(str(tiny_model_dir), 16, enabled=True)
    adapter = registry.load("good", str(good))
    assert (adapter.rank, adapter.scale, adapter.target_modules) == (8, 2.0, ("down_proj", "q_proj"))
    again = AdapterRegistry(str(tiny_model_dir), 16, enabled=True).load("good", str(good))
    assert again.version != adapter.version and again.cache_salt != adapter.cache_salt != 0
    with pytest.raises(AlreadyExists):
        registry.load("good", str(good))
    assert registry.list() == [adapter] and registry.get("good") is adapter
    registry.unload("good")
    with pytest.raises(NotFound, match="'good'"):
        registry.get("good")
    with pytest.raises(NotFound):
        registry.unload("good")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"r": 32}, "rank 32 exceeds --max-lora-rank 16"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "PROMPT_TUNING"}, "only LoRA"),
        ({"r": 4}, "shape"),  # the tensors are of rank 8
    ],
)
def test_the_registry_refuses_what_a_worker_could_not_run(
    tiny_model_dir: Path, good: Path, tmp_path: Path, config: dict[str, object], message: str
) -> None:
    registry = AdapterRegistry(str(tiny_model_dir), 16, enabled=True)
    with pytest.raises(InvalidArgument, match=message):
        registry.load("bad", str(_variant(good, tmp_path / "bad", **config)))


def test_the_registry_refuses_other_modules_models_names_and_a_disabled_server(
    tiny_model_dir: Path, smollm2_dir: Path, good: Path, tmp_path: Path
) -> None:
    registry = AdapterRegistry(str(tiny_model_dir), 16, enabled=True)
    embed = make_peft_adapter(tiny_model_dir, tmp_path / "embed", ("q_proj", "lm_head"))
    with pytest.raises(InvalidArgument, match="cannot"):
        registry.load("embed", str(embed))
    with pytest.raises(InvalidArgument, match="shape"):  # another model's hidden size
        AdapterRegistry(str(smollm2_dir), 16, enabled=True).load("good", str(good))
    with pytest.raises(InvalidArgument, match="not a directory|not a readable"):
        registry.load("missing", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match="printable"):
        registry.load("has space", str(good))
    with pytest.raises(InvalidArgument, match="--enable-lora"):
        AdapterRegistry(str(tiny_model_dir), 16, enabled=False).load("good", str(good))
