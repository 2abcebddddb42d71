"""CheckpointManager on real gloo ranks: save at world size 2, resume at 3 and at 1.

The resumed state must equal the saved one bitwise (model, optimizer moments and steps, scheduler,
trainer values), checked by saving it again from the new world size and comparing the two
checkpoints tensor by tensor; training then continues exactly like the uninterrupted run: the
engine's deterministic mode averages the gradients of the same micro-batches in the same order
at every world size, so losses and weights are bitwise equal. The rank
manager's pieces that need a real job run here too: ``RankManager.init`` inside an existing
process group, ``agree_any``, and a watchdog on the real c10d TCPStore.

The W=2 save, its follow-ups and the W=3 resume run in the spawns this module shares with
``test_checkpoint_manager_engines.py`` (``spawns`` in this folder's conftest.py).
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from ftsdp import storage

pytestmark = pytest.mark.timeout(600)  # the first test runs the shared spawns (conftest.py)
GLOBAL_BATCH, MICRO = 12, 1


def _build(seed: int):
    import ftsdp
    from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = ftsdp.FSDP(GPT(cfg), auto_wrap_policy={Block}, deterministic=True)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def _train(model, opt, sched, rank: int, world: int, trainer: dict, steps: int) -> list[float]:
    """Steps of the real loop's shape: the global sampler, no_sync accumulation, mean loss."""
    import contextlib

    import torch.distributed as dist

    from ftsdp.elastic import BatchGeometry, GlobalSampler
    from ftsdp.examples.data import MarkovDataset

    ds = MarkovDataset(64, 16, seed=0)
    sampler = GlobalSampler(len(ds), seed=0)
    g = BatchGeometry(global_batch=GLOBAL_BATCH, micro_batch=MICRO, world_size=world)
    losses = []
    for _ in range(steps):
        total = torch.zeros(())
        for micro in range(g.accum_steps):
            x, y = ds.batch(sampler.micro_batch(trainer["cursor"], g, rank, micro))
            ctx = contextlib.nullcontext() if micro == g.accum_steps - 1 else model.no_sync()
            with ctx:
                _, loss = model(x, y)
                loss.backward()  # deterministic mode: the engine averages all micro-batches
            total += loss.detach()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        gathered = [total]
        if world > 1:
            gathered = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(gathered, total)
        losses.append(sum(t.item() for t in gathered))  # rank sums, added in rank order
        trainer["step"] += 1
        trainer["cursor"] += GLOBAL_BATCH
    return losses


def _np(state: dict) -> dict:
    # numpy, not tensors: a tensor crosses the result queue as shared memory that vanishes when
    # the rank's process exits before the test reads it.
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def _save_phase(rank: int, world: int, url: str) -> dict:
    import time

    from ftsdp.checkpoint._manager import CheckpointManager
    from ftsdp.elastic import RankManager, Watchdog

    rm = RankManager.init(device="cpu", timeout_s=60)
    assert (rm.rank, rm.world_size) == (rank, world) and len(rm.incarnation) == 12
    assert [p.rank for p in rm.peers] == list(range(world))
    assert rm.agree_any(rank == 1, False, True) == (True, False, True)
    stalls: list = []
    dog = Watchdog(
        rm.store("wd"), rank, world, interval_s=0.1, heartbeat_timeout_s=2.0, on_stall=stalls.extend
    ).start()

    model, opt, sched = _build(0)
    ckpt = CheckpointManager(url, model, opt, lr_scheduler=sched, every_steps=3)
    trainer = {"step": 0, "cursor": 0, "tag": f"saved at {world}"}
    _train(model, opt, sched, rank, world, trainer, 3)
    dog.beat(3)
    assert ckpt.due(3)
    ckpt.save(3, trainer)  # async: training continues while it uploads
    _train(model, opt, sched, rank, world, trainer, 2)
    ckpt.save(5, trainer, block=True)
    ckpt.close()
    full_at_5 = model.state_dict()
    continued = _train(model, opt, sched, rank, world, trainer, 3)
    time.sleep(0.5)  # a few heartbeats while everybody is alive and progressing
    dog.close()
    assert stalls == [] and dog.error is None
    return {"full_at_5": _np(full_at_5), "continued": continued, "final": _np(model.state_dict())}


def _resume_phase(rank: int, world: int, url: str, again: str) -> dict:
    from ftsdp.checkpoint._manager import CheckpointManager

    model, opt, sched = _build(1)  # a different init: everything must come from the checkpoint
    ckpt = CheckpointManager(url, model, opt, lr_scheduler=sched, async_save=False)
    trainer = {"step": 0, "cursor": 0, "tag": ""}
    info = ckpt.resume(trainer)
    assert info is not None and info.step == 5 and info.saved_world_size == 2
    assert not info.rng_restored  # another world size: RNGs reseeded per rank
    assert trainer == {"step": 5, "cursor": 60, "tag": "saved at 2"}
    assert sched.last_epoch == 5
    CheckpointManager(again, model, opt, lr_scheduler=sched, async_save=False).save(5, trainer)
    full_at_5 = model.state_dict()
    continued = _train(model, opt, sched, rank, world, trainer, 3)
    return {"full_at_5": _np(full_at_5), "continued": continued, "final": _np(model.state_dict())}


@pytest.fixture(scope="module")
def saved(spawns):
    return spawns.saved()  # _save_phase at W=2


@pytest.mark.parametrize("world", [3, 1])
def test_resume_at_another_world_size(saved, spawns, tmp_path, world: int) -> None:
    url, ref = saved
    assert storage.list_steps(url) == [3, 5]
    again = str(tmp_path / "again")
    if world == 1:  # a world of one needs no process group: resume in this process
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # like every rank: CPU reductions depend on the thread count
        try:
            out = _resume_phase(0, 1, url, again)
        finally:
            torch.set_num_threads(threads)
    else:  # _resume_phase at W=3, in the shared spawn
        again, out = spawns.resumed_at_3()

    # The state loaded at the new world size is the saved state, bit for bit.
    original, resaved = storage.load_state_dict(url, 5), storage.load_state_dict(again, 5)
    assert original.keys() == resaved.keys()
    assert any(k.endswith(".exp_avg_sq") for k in original)
    for key in original:
        assert torch.equal(original[key], resaved[key]), key
    a, b = storage.catalog.read_manifest(url, 5), storage.catalog.read_manifest(again, 5)
    assert a.world_size == 2 and b.world_size == world
    # The engine's shards carry their place in the flat buffer: every tensor of a sharded save
    # is described by its rule, planned without exchanging ranges (docs/format.md, version 4).
    listed = [n for n, t in a.tensors.items() if t.rule is None]
    assert a.version == 4 and listed == [], listed
    assert a.values["optim.param_groups"] == b.values["optim.param_groups"]
    assert a.values["scheduler"] == b.values["scheduler"]
    for key, value in ref["full_at_5"].items():
        value = torch.from_numpy(value)
        assert torch.equal(value, torch.from_numpy(out["full_at_5"][key])), key
        if f"model.{key}" in original:  # a tied weight is saved once, under its first name
            assert torch.equal(value, original[f"model.{key}"]), key

    # Training goes on exactly as the uninterrupted world-size-2 run did.
    for key, value in ref["final"].items():
        assert torch.equal(torch.from_numpy(out["final"][key]), torch.from_numpy(value)), key
    if world == 1:  # one rank sums all micro-batch losses in the same order as two ranks do
        assert out["continued"] == pytest.approx(ref["continued"], rel=1e-6)


def _unexpected_error_phase(rank: int, world: int, url: str) -> str:
    from ftsdp.checkpoint._manager import CheckpointManager

    model, opt, sched = _build(1)
    real = storage.load
    if rank == 1:  # a bug-like error on one rank only, after the load's own collectives

        def broken(*args, **kwargs):
            real(*args, **kwargs)
            raise RuntimeError("unexpected on rank 1")

        storage.load = broken
    ckpt = CheckpointManager(url, model, opt, lr_scheduler=sched, async_save=False)
    try:
        ckpt.resume({"step": 0, "cursor": 0, "tag": ""})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        storage.load = real
    return "resumed"


def _fallback_phase(rank: int, world: int, url: str) -> dict:
    from ftsdp.checkpoint._manager import CheckpointManager

    model, opt, sched = _build(1)
    ckpt = CheckpointManager(url, model, opt, lr_scheduler=sched, async_save=False)
    trainer = {"step": 0, "cursor": 0, "tag": ""}
    info = ckpt.resume(trainer)
    out: dict = {"resumed": info.step, "skipped": [s for s, _ in info.skipped]}
    try:  # behind the newer step 5 without the fallback's discard: refused on every rank
        storage.save({"x": torch.zeros(4)}, url, step=4)
        out["behind"] = "saved"
    except Exception as e:
        out["behind"] = f"{type(e).__name__}: {e}"
    _train(model, opt, sched, rank, world, trainer, 2)
    ckpt.save(5, trainer)  # the step it fell back past: discarded and saved again
    ckpt.close()
    out["steps"] = storage.list_steps(url)
    return out


def _followups(rank: int, world: int, url: str, corrupt: str) -> dict:
    """Both follow-up phases, after the save in the same W=2 spawn (each spawn costs seconds)."""
    return {
        "unexpected": _unexpected_error_phase(rank, world, url),
        "fallback": _fallback_phase(rank, world, corrupt),
    }


def _corrupt_copy_phase(rank: int, world: int, url: str, corrupt: str) -> None:
    """Rank 0 copies the saved run to ``corrupt`` and flips a byte of step 5's largest object;
    every rank waits for it."""
    import shutil

    import torch.distributed as dist

    if rank == 0:
        run = pathlib.Path(corrupt)
        shutil.copytree(url, run)
        obj = max((run / "step-5").glob("*.safetensors"), key=lambda p: p.stat().st_size)
        data = bytearray(obj.read_bytes())
        data[-5] ^= 0xFF
        obj.write_bytes(bytes(data))
    dist.barrier()


@pytest.fixture(scope="module")
def followups(saved, spawns) -> tuple[pathlib.Path, list[dict]]:
    """Step 5 of a copy of the saved run is corrupt; the shared W=2 spawn ran both follow-ups
    after the save (``_corrupt_copy_phase``, ``_followups``)."""
    return spawns.followups()


def test_an_unexpected_error_on_one_rank_fails_every_rank_instead_of_hanging(followups) -> None:
    out = [r["unexpected"] for r in followups[1]]
    assert out[1] == "RuntimeError: unexpected on rank 1", out
    assert out[0].startswith("StateMismatchError") and "another rank" in out[0], out


def test_after_a_fallback_every_rank_saves_the_skipped_step_again(saved, followups) -> None:
    """Step 5 is corrupt: the resume falls back to 3. A save behind 5 is refused on every rank;
    the manager's save of step 5 replaces the abandoned one (the old code failed it with
    FileExistsError on every rank), and training from 3 reaches the same step-5 state."""
    _, ref = saved
    run, outs = followups
    for r in (o["fallback"] for o in outs):
        assert r["resumed"] == 3 and r["skipped"] == [5], r
        assert "newer than it exist: [5]" in r["behind"] and "discard_newer" in r["behind"], r
        assert r["steps"] == [3, 5], r
    assert not (run / "step-4").exists()  # refused before anything was written
    resaved = storage.load_state_dict(str(run), 5)
    for key, value in ref["full_at_5"].items():
        if f"model.{key}" in resaved:
            assert torch.equal(resaved[f"model.{key}"], torch.from_numpy(value)), key


def _node_memory_phase(rank: int, world: int, root: str) -> dict:
    """W=4 as two simulated nodes (``$FTSDP_NODE``; ranks 0-1 and 2-3), each with a memory root
    of its own: two memory saves, node 1's root wiped (its machine lost), then a fresh model,
    optimizer and manager resume from memory (node 0's replica of node 1's shards)."""
    import os
    import shutil

    import torch.distributed as dist

    from ftsdp.checkpoint._manager import CheckpointManager

    node = rank // 2
    os.environ["FTSDP_NODE"] = f"node{node}"
    shm = [f"{root}/shm-node{n}" for n in range(2)]
    try:

        def manager(model, opt, sched):
            return CheckpointManager(
                f"{root}/durable", model, opt, lr_scheduler=sched, memory_url=shm[node]
            )

        model, opt, sched = _build(0)
        ckpt = manager(model, opt, sched)
        trainer = {"step": 0, "cursor": 0}
        assert ckpt.resume(trainer) is None
        for _ in range(2):
            _train(model, opt, sched, rank, world, trainer, 1)
            ckpt.save_to_memory(trainer["step"], trainer)
        ckpt.wait()
        held = {n: sorted(os.listdir(f"{shm[n]}/step-2")) for n in range(2)}
        saved = _np(model.state_dict())
        saved_optim = [
            {k: v.clone() for k, v in opt.state[p].items()}
            for _, p in sorted(ckpt.engine.params_by_name().items())
        ]
        continued = _train(model, opt, sched, rank, world, trainer, 1)
        dist.barrier()
        if rank == 2:  # node 1's shared memory is gone with its machine
            shutil.rmtree(shm[1])
        dist.barrier()

        model, opt, sched = _build(1)  # everything must come from node 0's memory
        ckpt = manager(model, opt, sched)
        trainer = {"step": 0, "cursor": 0}
        info = ckpt.resume(trainer)
        assert info is not None and info.step == 2 and ckpt.resumed_from == shm[node]
        assert trainer == {"step": 2, "cursor": 2 * GLOBAL_BATCH}
        state = _np(model.state_dict())
        optim = [
            {k: v.clone() for k, v in opt.state[p].items()}
            for _, p in sorted(ckpt.engine.params_by_name().items())
        ]
        same_optim = all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(saved_optim, optim, strict=True)
        )
        again = _train(model, opt, sched, rank, world, trainer, 1)
        restored = storage.list_steps(shm[1])
        ckpt.close()
        dist.barrier()  # every node's first rank has cleared its root
        left = [os.path.exists(p) for p in shm]
    finally:
        del os.environ["FTSDP_NODE"]
    return {
        "held": held,
        "same_model": all((saved[k] == state[k]).all() for k in saved),
        "same_optim": same_optim,
        "continued": (continued, again),
        "restored": restored,
        "left": left,
    }


def test_a_lost_node_resumes_from_the_replica_in_its_peers_memory(spawns) -> None:
    per_rank = spawns.result(4, "manager.node_memory")
    held = per_rank[0]["held"]
    ranks = {n[: len("rank00000")] for n in held[0] if n.endswith(".safetensors")}
    assert held[0] == held[1] and ranks == {f"rank{r:05d}" for r in range(4)}  # own + replica
    for r in per_rank:
        assert r["same_model"] and r["same_optim"]
        assert r["continued"][0] == r["continued"][1]  # the next step too, bitwise
        assert 2 in r["restored"]  # node 1 got the step back from node 0
        assert r["left"] == [False, False]  # close() cleared both nodes' roots
