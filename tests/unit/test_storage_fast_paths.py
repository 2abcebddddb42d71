"""The fast paths of load and async save: direct copies into targets, staging-buffer reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving import _save

# Tiny blocks, objects and parts so that copies span several parts, pieces and objects.
SAVE = storage.SaveOptions(checksum_block_bytes=64, object_bytes=1000)
LOAD = storage.LoadOptions(io=storage.IOOptions(part_bytes=100, threads=3))


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "p": torch.randn(10, generator=g),
        "s": torch.tensor(3.0),
    }


@pytest.mark.parametrize("url", ["local", "memory"])
def test_load_into_any_target_layout(tmp_path: Path, url: str) -> None:
    root = str(tmp_path) if url == "local" else f"memory://fast-{tmp_path.name}"
    src = _source()
    storage.save(src, root, 1, options=SAVE)
    param = torch.nn.Parameter(torch.zeros(10))
    version = param._version
    target = {
        "w": torch.zeros(32, 64).t(),  # not contiguous: through staging
        "b": torch.zeros(7),  # another dtype: through staging, with cast=True
        "p": param,  # a leaf that requires grad: copied directly, autograd told
        "s": torch.tensor(0.0),  # 0-dim
    }
    storage.load(target, root, cast=True, options=LOAD)
    torch.testing.assert_close(target["w"], src["w"], rtol=0, atol=0)
    torch.testing.assert_close(target["b"], src["b"].float(), rtol=0, atol=0)
    torch.testing.assert_close(param.detach(), src["p"], rtol=0, atol=0)
    assert param.requires_grad and param._version > version
    assert target["s"].item() == 3.0
    # A flat shard whose local tensor is a strided view.
    base = torch.zeros(1000)
    shard = storage.FlatShard((64, 32), 1000, base[::2])
    other = {
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "p": torch.zeros(10),
        "s": torch.tensor(0.0),
    }
    storage.load({"w": shard, **other}, root, options=LOAD)
    torch.testing.assert_close(shard.local, src["w"].reshape(-1)[1000:1500], rtol=0, atol=0)


def test_async_save_reuses_staging_memory(tmp_path: Path) -> None:
    """An async save stages into its root's snapshot arena, kept for the next save of the
    same state; every save holds the values of its moment."""
    state = _source()
    first = {k: v.clone() for k, v in state.items()}
    h = storage.save(state, str(tmp_path), 1, async_save=True, options=SAVE)
    h.wait()
    arena = _save._lanes[Store(str(tmp_path), None).where()].arena
    kept = {b.data_ptr() for b in arena._bufs.values()}
    assert arena.held_bytes() >= sum(v.numel() * v.element_size() for v in state.values())
    state["w"].add_(1.0)
    h = storage.save(state, str(tmp_path), 2, async_save=True, options=SAVE)
    h.wait()
    assert {b.data_ptr() for b in arena._bufs.values()} == kept, "the next save reuses it"
    for step, values in ((1, first), (2, state)):
        target = {k: torch.zeros_like(v) for k, v in values.items()}
        storage.load(target, str(tmp_path), step)
        for k, v in values.items():
            assert torch.equal(target[k], v), (step, k)
    off = storage.SaveOptions(checksum_block_bytes=64, object_bytes=1000, reuse_staging=False)
    storage.save(state, str(tmp_path), 3, async_save=True, options=off).wait()
    assert not _save._staging_pool._free


def test_mapping_a_truncated_object_raises(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(b"x" * 100)
    store = Store(str(tmp_path), None)
    assert bytes(store.map_range("obj", 10, 100)) == b"x" * 90
    with pytest.raises(OSError, match="truncated"):
        store.map_range("obj", 50, 101)


def test_a_flat_shards_leaf_is_kept_between_saves_and_follows_its_tensor(tmp_path: Path) -> None:
    """The walk of the state keeps a FlatShard's leaf on the shard (it is frozen); the leaf is
    made again under another name or once its tensor was resized, and every save holds the
    values of its moment."""
    from ftsdp.storage.format._state import flatten_state

    flat = torch.arange(12.0)
    shard = storage.FlatShard((3, 4), 0, flat)
    first = flatten_state({"w": shard})[0]["w"]
    assert flatten_state({"w": shard})[0]["w"] is first
    assert flatten_state({"v": shard})[0]["v"].name == "v"
    url = str(tmp_path)
    for step in (1, 2):
        flat.mul_(2)
        storage.save({"w": shard}, url, step)
        assert torch.equal(storage.load_state_dict(url, step=step)["w"], flat.view(3, 4))
    flat.resize_(6)  # a shard that no longer fits its global shape: the kept leaf is not used
    with pytest.raises(ValueError, match=r"elements \[6, 12\) are not covered"):
        storage.save({"w": shard}, url, 3)


def test_a_kept_state_is_walked_once_and_its_leaves_taken_while_it_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeptState flattens as the plain mapping would; met again under the same name it is
    not walked (its leaves are the same objects), under another name or as a new object it
    is; a name clash with the rest of the state raises on every walk; its entry goes with it;
    and saves of it hold the values of their moment."""
    import gc

    from ftsdp.storage.format import _state
    from ftsdp.storage.format._state import flatten_state

    w, m = torch.arange(6.0), torch.ones(3)
    part = {"w": w, "opt": {"m": m, "step": 3}, "layers": [w[:2]]}
    kept = storage.KeptState(part)
    with pytest.raises(TypeError):
        kept["w"] = w  # type: ignore[index]
    plain_t, plain_v = flatten_state({"model": part, "lr": 0.1})
    first_t, first_v = flatten_state({"model": kept, "lr": 0.1})
    assert list(first_t) == list(plain_t) and list(first_v) == list(plain_v)
    assert {n: v.value for n, v in first_v.items()} == {"model.opt.step": 3, "lr": 0.1}
    for name, leaf in plain_t.items():
        assert first_t[name].local is leaf.local and first_t[name].range == leaf.range

    walked = []
    real = _state._tensor_leaf
    monkeypatch.setattr(_state, "_tensor_leaf", lambda n, o: walked.append(n) or real(n, o))
    again_t, again_v = flatten_state({"model": kept, "lr": 0.2})
    assert walked == [] and all(again_t[n] is first_t[n] for n in first_t)
    assert again_v["lr"].value == 0.2 and again_v["model.opt.step"] is first_v["model.opt.step"]
    assert set(flatten_state({"other": kept})[0]) == {n.replace("model", "other") for n in first_t}
    assert walked == ["other.w", "other.opt.m", "other.layers.0"]
    walked.clear()
    flatten_state({"model": storage.KeptState(part)})  # a new object: walked
    assert len(walked) == 3
    for _ in range(2):
        with pytest.raises(ValueError, match="same name 'model.w'"):
            flatten_state({"model": kept, "model.w": 1})
    short = storage.KeptState({"w": w})
    flatten_state({"short": short})
    assert any(hit[0]() is short for hit in _state._walked.values())
    n = len(_state._walked)
    del short
    gc.collect()
    assert len(_state._walked) == n - 1  # its entry went with it

    url, kept = str(tmp_path), storage.KeptState({"w": w})
    for step in (1, 2):
        w.mul_(2)
        storage.save({"model": kept, "step": step}, url, step)
        got = storage.load_state_dict(url, step=step)
        assert torch.equal(got["model.w"], w)
