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
    assert arena._leaves is not None
    kept = {t.data_ptr() for t in arena._leaves[1]}
    assert arena.held_bytes() >= sum(v.numel() * v.element_size() for v in state.values())
    state["w"].add_(1.0)
    h = storage.save(state, str(tmp_path), 2, async_save=True, options=SAVE)
    h.wait()
    assert {t.data_ptr() for t in arena._leaves[1]} == kept, "the next save reuses them"
    for step, values in ((1, first), (2, state)):
        target = {k: torch.zeros_like(v) for k, v in values.items()}
        storage.load(target, str(tmp_path), step)
        for k, v in values.items():
            assert torch.equal(target[k], v), (step, k)
    off = storage.SaveOptions(checksum_block_bytes=64, object_bytes=1000, reuse_staging=False)
    storage.save(state, str(tmp_path), 3, async_save=True, options=off).wait()
    assert arena.held_bytes() == 0, "reuse_staging=False frees the snapshot memory"


def test_mapping_a_truncated_object_raises(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(b"x" * 100)
    store = Store(str(tmp_path), None)
    assert bytes(store.map_range("obj", 10, 100)) == b"x" * 90
    with pytest.raises(OSError, match="truncated"):
        store.map_range("obj", 50, 101)


def test_saves_of_one_flat_shard_follow_its_tensor(tmp_path: Path) -> None:
    """Every save of the same FlatShard holds the values of its moment; once its tensor was
    resized to no longer fit its global shape, a save refuses it."""
    flat = torch.arange(12.0)
    shard = storage.FlatShard((3, 4), 0, flat)
    url = str(tmp_path)
    for step in (1, 2):
        flat.mul_(2)
        storage.save({"w": shard}, url, step)
        assert torch.equal(storage.load_state_dict(url, step=step)["w"], flat.view(3, 4))
    flat.resize_(6)
    with pytest.raises(ValueError, match=r"elements \[6, 12\) are not covered"):
        storage.save({"w": shard}, url, 3)


def _mapping_of(address: int) -> dict[str, str]:
    """The fields of the /proc/self/smaps entry of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
                fields = {"range": head} if inside else fields
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


_THP = Path("/sys/kernel/mm/transparent_hugepage")


def _advised_huge(entry: dict[str, str]) -> bool:
    """Whether the mapping carries the huge page advice (``hg`` among its VmFlags)."""
    return "hg" in entry["VmFlags"].split()


def test_fresh_host_memory_is_private_zeroed_and_in_small_pages() -> None:
    """Staging and S3 read buffers: new zeroed memory of exactly the size asked, a private
    mapping of their own (not mmap's shared default), not advised to be huge pages: a
    process's first huge pages cost a first save 4x its blocking on this project's machine
    (docs/benchmarks.md, "First call: what was slow")."""
    from ftsdp.storage.io._buffers import host_buffer

    assert host_buffer(0).numel() == 0
    n = 8 << 20
    a, b = host_buffer(n), host_buffer(n)
    assert a.dtype == torch.uint8 and a.numel() == n and not a.any()
    a.fill_(7)
    assert not b.any(), "each buffer is memory of its own"
    if not _THP.exists():  # not Linux, or a kernel without huge pages: nothing more to see
        return
    entry = _mapping_of(a.data_ptr())
    assert int(entry["Anonymous"].split()[0]) * 1024 >= n, "private anonymous memory, written"
    assert not _advised_huge(entry), entry


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the pages of ``t``'s memory are resident (``mincore``, page by page: two
    adjacent mappings may be one entry of /proc/self/smaps)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    count = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, count * page, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_read_buffers_are_mapped_before_the_read_writes_them() -> None:
    """A ranged read's buffer (``populate``) has every page resident when ``host_buffer``
    returns, so the S3 client's event-loop thread, which writes every body, takes no page
    fault; a staging buffer's pages are mapped on first write (its copies touch them on
    several threads)."""
    import mmap

    from ftsdp.storage.io._buffers import host_buffer

    if not _THP.exists() or not hasattr(mmap, "MAP_POPULATE"):
        pytest.skip("needs Linux's MAP_POPULATE and mincore")
    n = 8 << 20
    read, staging = host_buffer(n, populate=True), host_buffer(n)
    assert _resident_pages(read) == n // mmap.PAGESIZE
    assert _resident_pages(staging) < n // mmap.PAGESIZE // 2
    staging.fill_(1)
    assert _resident_pages(staging) == n // mmap.PAGESIZE
    assert not read.any() and read.numel() == n


def test_tensors_loaded_for_inference_are_advised_huge_pages(tmp_path: Path) -> None:
    """``load_state_dict`` hands out tensors that torch allocated (and frees), on the CPU
    whatever the default device, whose whole 2 MiB pages were advised to be huge before the
    load wrote them (memory reused from the heap may keep its small pages)."""
    big = torch.arange(4 << 20, dtype=torch.float32).reshape(2048, 2048)  # 16 MiB
    storage.save({"big": big, "small": torch.ones(3)}, str(tmp_path), 1)
    loaded = storage.load_state_dict(str(tmp_path))
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["small"], torch.ones(3))
    with torch.device("meta"):
        assert storage.load_state_dict(str(tmp_path), device="cpu")["big"].device.type == "cpu"
    if _THP.exists():
        assert _advised_huge(_mapping_of(loaded["big"].data_ptr() + (8 << 20)))
