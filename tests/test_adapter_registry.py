"""AdapterRegistry: PEFT adapters made by peft on the tiny model are accepted with their rank,
scale and modules; every adapter a worker could not serve is refused, one defect at a time,
before any worker sees it."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from common.errors import AlreadyExists, InvalidArgument, NotFound
from scheduler_svc.lora.adapter_registry import Adapter, AdapterRegistry
from tests.adapters import ATTENTION, MLP, make_peft_adapter

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def good_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "all", ATTENTION + MLP, rank=8, alpha=16)


def _registry(model_dir: Path, max_lora_rank: int = 64, enabled: bool = True) -> AdapterRegistry:
    return AdapterRegistry(str(model_dir), max_lora_rank, enabled)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def _edit_tensors(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_a_peft_adapter_is_registered_with_its_rank_scale_and_modules(tiny_model_dir: Path, good_adapter: Path) -> None:
    reg = _registry(tiny_model_dir)
    a = reg.load("all", str(good_adapter))
    assert (a.name, a.path, a.rank, a.scale) == ("all", str(good_adapter), 8, 2.0)
    assert a.target_modules == tuple(sorted(ATTENTION + MLP))
    assert reg.get("all") is a and reg.list() == [a]


def test_rslora_scale_and_attention_only_targets(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = make_peft_adapter(tiny_model_dir, tmp_path / "rs", ("v_proj", "q_proj"), rank=4, alpha=8, rslora=True)
    a = _registry(tiny_model_dir).load("rs", str(path))
    assert a.target_modules == ("q_proj", "v_proj")
    assert math.isclose(a.scale, 8 / math.sqrt(4))


def test_versions_and_cache_salts_differ_per_registration(tiny_model_dir: Path, good_adapter: Path) -> None:
    reg = _registry(tiny_model_dir)
    first = reg.load("x", str(good_adapter))
    second = reg.load("y", str(good_adapter))
    assert reg.unload("x") is first
    again = reg.load("x", str(good_adapter))
    versions = {first.version, second.version, again.version}
    salts = {first.cache_salt, second.cache_salt, again.cache_salt}
    assert len(versions) == 3 and len(salts) == 3 and 0 not in salts
    assert [a.name for a in reg.list()] == ["y", "x"]  # registration order
    assert first.cache_salt == Adapter(**{**first.__dict__}).cache_salt  # a value, not an identity


def test_names_are_unique_and_unknown_names_are_not_found(tiny_model_dir: Path, good_adapter: Path) -> None:
    reg = _registry(tiny_model_dir)
    reg.load("a", str(good_adapter))
    with pytest.raises(AlreadyExists, match="'a'"):
        reg.load("a", str(good_adapter))
    with pytest.raises(NotFound, match="adapter 'b' is not loaded"):
        reg.get("b")
    with pytest.raises(NotFound, match="'b'"):
        reg.unload("b")


def test_lora_off_is_refused_naming_the_flag(tiny_model_dir: Path, good_adapter: Path) -> None:
    with pytest.raises(InvalidArgument, match="--enable-lora"):
        _registry(tiny_model_dir, enabled=False).load("a", str(good_adapter))


@pytest.mark.parametrize("name", ["", "x" * 129, "has space", "tab\t", "é", "nul\0"])
def test_bad_names_are_refused(tiny_model_dir: Path, good_adapter: Path, name: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        _registry(tiny_model_dir).load(name, str(good_adapter))
    assert error.value.field == "name"


def test_a_name_of_128_characters_is_accepted(tiny_model_dir: Path, good_adapter: Path) -> None:
    assert _registry(tiny_model_dir).load("n" * 128, str(good_adapter)).name == "n" * 128


def _drop(name: str) -> Callable[[Path], object]:
    return lambda p: (p / name).unlink()


def _rename_first_to(new: str) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        key = sorted(t)[0]
        t[new] = t.pop(key)

    return edit


def _reshape(module: str, part: str, shape: tuple[int, int]) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        key = f"{PREFIX}.0.{'mlp' if module in MLP else 'self_attn'}.{module}.lora_{part}.weight"
        t[key] = np.zeros(shape, np.float32)

    return edit


def _remove(key: str) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        del t[key]

    return edit


# Tiny model: hidden 64, 4 heads of 16, 2 KV heads (32 wide), intermediate 128, 2 layers; r = 8.
BAD: dict[str, tuple[Callable[[Path], object], str]] = {
    "no config": (_drop("adapter_config.json"), "adapter_config.json"),
    "no tensors": (_drop("adapter_model.safetensors"), "adapter_model.safetensors"),
    "config not json": (lambda p: (p / "adapter_config.json").write_text("{"), "not a readable"),
    "not lora": (lambda p: _edit_config(p, peft_type="PREFIX_TUNING"), "peft_type LORA"),
    "rank over the limit": (lambda p: _edit_config(p, r=128), "--max-lora-rank"),
    "dora": (lambda p: _edit_config(p, use_dora=True), "DoRA"),
    "bias": (lambda p: _edit_config(p, bias="lora_only"), "bias"),
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "rank_pattern": (lambda p: _edit_config(p, rank_pattern={"q_proj": 4}), "rank_pattern"),
    "alpha_pattern": (lambda p: _edit_config(p, alpha_pattern={"q_proj": 4}), "alpha_pattern"),
    "lora_bias": (lambda p: _edit_config(p, lora_bias=True), "lora_bias"),
    "target_parameters": (lambda p: _edit_config(p, target_parameters=["experts.w1"]), "target_parameters"),
    "layer_replication": (lambda p: _edit_config(p, layer_replication=[[0, 2]]), "layer_replication"),
    "alora": (lambda p: _edit_config(p, alora_invocation_tokens=[5]), "alora_invocation_tokens"),
    "qalora": (lambda p: _edit_config(p, use_qalora=True), "QALoRA"),
    "fan_in_fan_out": (lambda p: _edit_config(p, fan_in_fan_out=True), "fan_in_fan_out"),
    "trainable tokens": (lambda p: _edit_config(p, trainable_token_indices=[3]), "trainable token"),
    "rank zero": (lambda p: _edit_config(p, r=0), "positive integer"),
    "dora magnitude tensor": (
        lambda p: _edit_tensors(p, _rename_first_to(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector")),
        "adapts a module no slot holds",
    ),
    "embedding tensor": (
        lambda p: _edit_tensors(p, _rename_first_to("base_model.model.model.embed_tokens.lora_A.weight")),
        "adapts a module no slot holds",
    ),
    "lm_head tensor": (
        lambda p: _edit_tensors(p, _rename_first_to("base_model.model.lm_head.lora_A.weight")),
        "adapts a module no slot holds",
    ),
    "expert tensor": (
        lambda p: _edit_tensors(p, _rename_first_to(f"{PREFIX}.0.mlp.experts.0.up_proj.lora_A.weight")),
        "adapts an expert",
    ),
    "layer past the model": (
        lambda p: _edit_tensors(p, _rename_first_to(f"{PREFIX}.2.self_attn.q_proj.lora_A.weight")),
        "layer 2",
    ),
    "A of the wrong width": (lambda p: _edit_tensors(p, _reshape("q_proj", "A", (8, 32))), "shape"),
    "B of the wrong height (k is 32 wide)": (lambda p: _edit_tensors(p, _reshape("k_proj", "B", (64, 8))), "shape"),
    "down_proj A not intermediate wide": (lambda p: _edit_tensors(p, _reshape("down_proj", "A", (8, 64))), "shape"),
    "A of another rank than r": (lambda p: _edit_tensors(p, _reshape("v_proj", "A", (4, 64))), "shape"),
    "A without B": (lambda p: _edit_tensors(p, _remove(f"{PREFIX}.1.mlp.up_proj.lora_B.weight")), "without"),
    "integer tensor": (
        lambda p: _edit_tensors(
            p, lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": np.zeros((8, 64), np.int32)})
        ),
        "dtype",
    ),
    "truncated file": (
        lambda p: (p / "adapter_model.safetensors").write_bytes((p / "adapter_model.safetensors").read_bytes()[:-100]),
        "truncated",
    ),
    "not safetensors": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"\xff" * 64), "safetensors"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_defect_is_refused_naming_it(tiny_model_dir: Path, good_adapter: Path, tmp_path: Path, case: str) -> None:
    damage, words = BAD[case]
    path = _copy(good_adapter, tmp_path / "bad")
    damage(path)
    reg = _registry(tiny_model_dir, max_lora_rank=64)
    with pytest.raises(InvalidArgument, match=words) as error:
        reg.load("bad", str(path))
    assert error.value.field == "path"
    assert reg.list() == []  # nothing half-registered
    assert reg.load("good", str(good_adapter)).name == "good"  # the refusal left the registry usable


def test_a_missing_directory_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not a directory") as error:
        _registry(tiny_model_dir).load("a", str(tmp_path / "nowhere"))
    assert error.value.field == "path"


def test_mlp_adapters_are_refused_on_a_mixture_of_experts_model(
    tiny_model_dir: Path, good_adapter: Path, tmp_path: Path
) -> None:
    moe = _copy(tiny_model_dir, tmp_path / "moe")
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(InvalidArgument, match="mixture-of-experts"):
        _registry(moe).load("a", str(good_adapter))


def test_shapes_follow_an_explicit_head_dim(tiny_model_dir: Path, good_adapter: Path, tmp_path: Path) -> None:
    """head_dim 32 makes q 128 wide and k/v 64: the tiny model's adapter no longer fits."""
    model = _copy(tiny_model_dir, tmp_path / "wide-heads")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "head_dim": 32}))
    with pytest.raises(InvalidArgument, match="shape"):
        _registry(model).load("a", str(good_adapter))


def test_a_relative_path_is_made_absolute(
    tiny_model_dir: Path, good_adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(good_adapter.parent)
    a = _registry(tiny_model_dir).load("a", good_adapter.name)
    assert a.path == str(good_adapter)


def test_the_workers_adapt_exactly_the_modules_the_registry_accepts() -> None:
    # The registry (no torch) and the worker's slots share common/lora_format.py; a module one
    # side knows and the other does not would be accepted here and refused by every worker.
    from common.lora_format import MODULES
    from worker_svc.lora.lora_slots import TARGETS

    assert set(TARGETS) == set(MODULES)


# ---- a root to load from (--lora-root) ----


@pytest.fixture
def lora_root(tmp_path: Path, good_adapter: Path) -> Path:
    """root/inside (an adapter), root/out-link -> an adapter outside, root/file, root/leaky:
    an adapter dir whose safetensors file links outside; beside it outside/ (an adapter)."""
    root = tmp_path / "root"
    root.mkdir()
    _copy(good_adapter, root / "inside")
    outside = _copy(good_adapter, tmp_path / "outside")
    (root / "out-link").symlink_to(outside, target_is_directory=True)
    (root / "file").write_text("not a directory")
    leaky = _copy(good_adapter, root / "leaky")
    (leaky / "adapter_model.safetensors").unlink()
    (leaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    return root


def test_with_a_root_adapters_load_from_inside_it_only(tiny_model_dir: Path, lora_root: Path) -> None:
    from scheduler_svc.lora.adapter_registry import OUTSIDE_ROOT

    reg = AdapterRegistry(str(tiny_model_dir), 64, True, root=str(lora_root))
    assert reg.load("a", str(lora_root / "inside")).path == str(lora_root / "inside")
    assert reg.load("b", "inside").path == str(lora_root / "inside")  # relative: to the root
    outside = lora_root.parent / "outside"
    refused = [
        str(outside),  # outside, and it exists
        str(lora_root / "out-link"),  # inside, but a link out
        "out-link",
        "../outside",
        str(lora_root / "missing"),
        str(lora_root.parent / "missing"),
        str(lora_root / "file"),
        str(lora_root / "leaky"),  # a file of it links out
        "inside\0",
    ]
    messages = set()
    for i, path in enumerate(refused):
        with pytest.raises(InvalidArgument) as error:
            reg.load(f"x{i}", path)
        assert error.value.field == "path"
        messages.add(str(error.value))
    # One answer for everything: a caller learns nothing of what lies where.
    assert messages == {f"path: {OUTSIDE_ROOT}"}
    assert [a.name for a in reg.list()] == ["a", "b"]


def test_without_a_root_startup_adapters_load_from_anywhere(tiny_model_dir: Path, lora_root: Path) -> None:
    reg = _registry(tiny_model_dir)
    assert reg.load("a", str(lora_root.parent / "outside")).name == "a"
    assert reg.load("b", str(lora_root / "out-link")).name == "b"


def test_check_reads_without_registering_and_add_keeps_names_unique(tiny_model_dir: Path, good_adapter: Path) -> None:
    reg = _registry(tiny_model_dir)
    first, second = reg.check("a", str(good_adapter)), reg.check("a", str(good_adapter))
    assert reg.list() == [] and first.version != second.version
    reg.add(first)
    with pytest.raises(AlreadyExists):
        reg.add(second)  # two loads of one name racing: the second is refused
    assert reg.list() == [first]
