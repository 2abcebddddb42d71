"""N-D states (FSDP2 over tensor parallelism): storage and CheckpointManager, against torch DCP
and an unwrapped model.

A model of two blocks, each an up projection (``ColwiseParallel``) and a down projection
(``RowwiseParallel``), is ``fully_shard``-ed over the dp dim of a 2-D mesh: its state holds
``(_StridedShard(0), Shard(0))`` row slabs, ``(Shard(0), Shard(1))`` boxes, ``(Shard(0),
Replicate())`` biases and 1-D ``Shard(0)`` norms, with AdamW's state beside them. Three spawns:

- W=4 (dp=2 x tp=2): one step, then the state saved by ``storage.save`` and by ``dcp.save``; the
  same model under FSDP2 alone (dp=4) saved the same way; a ``Partial`` DTensor refused; then
  both checkpoints loaded back into dp=2 x tp=2;
- W=3 (dp=3) and W=2 (tp=2): both checkpoints loaded into fresh models;
- at W=4 rank 0 also reshards the FSDP2-alone checkpoint offline to a 2 x 2 mesh with the
  dp x tp model's placements (``reshard(mesh=(2, 2))``), which every spawn loads: its grids are
  the ones the dp x tp save wrote, and it loads what DCP loads from the checkpoint it came from.

Every load is compared bitwise with what ``dcp.load`` puts into the same fresh model from the
same state; in one process, ``load_state_dict`` and ``LazyStateDict`` against the full tensors
gathered at save time. Bytes read against bytes needed are reported per rank: the checkpoints
use 64-byte checksum blocks, so that the amplification measured is the plan's, not the widening
of these small tensors to the default 1 MiB blocks.

The same spawns (and one rank in the test process) run a job under ``CheckpointManager`` (its
defaults: async, deferred copy): 4 steps at dp=2 x tp=2 saving every 2 and going on to step 5,
then resumed from step 4 at dp=3, at tp=2 and on one rank with the model unwrapped; each resume
runs step 5. Data: a global batch of 12 samples in the elastic sampler's order, split over the
dp ranks only (the tp ranks of a dp rank share its samples). Every step 5 must equal the
unwrapped reference: a model in this process that loaded step 4 with ``load_state_dict`` and
took the step on the whole batch.

The spawns are the W=4, 3 and 2 spawns this folder's modules share (its conftest.py): the saves
run in the W=4 spawn after the other modules' phases, and that spawn runs before the other two.
"""

from __future__ import annotations

import pytest
import torch

from ftsdp import storage

pytestmark = pytest.mark.timeout(600)  # the first test may run the shared spawns (conftest.py)

BLOCK = 64
D, H = 32, 64
# first match wins: AdamW's scalar steps, then the column-parallel up projections' row quarters;
# the rest take the defaults (S0,S1 weights, S0,R 1-D)
MESH_RULES = [("*.step", "R,R"), ("*.up.*", "S0,S0")]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, H)
        self.down = torch.nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


_MODEL: list = []  # the last model _build made and its dp rank


def _build(dp: int, tp: int, step: bool = True) -> dict:
    """The model on a dp x tp mesh (tp=1: FSDP2 alone), after one AdamW step (``step``), and its
    state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = _Net()
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (dp,))
    for b in model.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    _MODEL[:] = [model, dp_mesh.get_local_rank()]
    if not step:
        return {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """Dotted name -> DTensor/tensor leaf of ``state``."""
    out = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            out[prefix] = obj

    walk("", state)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _zero(state: dict) -> None:
    for t in _tensors(state).values():
        _local(t).zero_()


def _placements(state: dict) -> dict[str, str]:
    return {n: str(getattr(t, "placements", "tensor")) for n, t in _tensors(state).items()}


def _load_both(dp: int, tp: int, ft: str, ref: str) -> dict:
    """Load ``ft`` (ftsdp) and ``ref`` (DCP) into fresh models at dp x tp; compare locals."""
    import torch.distributed.checkpoint as dcp

    mine, theirs = _build(dp, tp), _build(dp, tp)
    _zero(mine)
    _zero(theirs)
    result = storage.load(mine, ft)
    dcp.load(theirs, checkpoint_id=ref)
    a, b = _tensors(mine), _tensors(theirs)
    differ = [n for n in a if not torch.equal(_local(a[n]), _local(b[n]))]
    zero = [n for n in a if _local(a[n]).numel() and not _local(a[n]).abs().sum()]
    return {
        "differ": differ,
        "zero": zero,
        "read": result.bytes_read,
        "needed": result.bytes_needed,
        "placements": _placements(mine),
    }


def _saves(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    options = storage.SaveOptions(checksum_block_bytes=BLOCK)
    out: dict = {}
    state = _build(2, 2)
    out["placements"] = _placements(state)
    storage.save(state, f"{root}/nd", 1, options=options)
    dcp.save(state, checkpoint_id=f"{root}/nd-dcp")
    out["full"] = {
        n: t.full_tensor() for n, t in _tensors(state).items() if hasattr(t, "full_tensor")
    }
    flat = _build(4, 1)
    storage.save(flat, f"{root}/flat", 1, options=options)
    dcp.save(flat, checkpoint_id=f"{root}/flat-dcp")
    if rank == 0:  # the column-parallel row quarters: (_StridedShard(0), Shard(0)) boxes
        storage.conversion.reshard(
            f"{root}/flat", f"{root}/mesh", mesh=(2, 2), placements=MESH_RULES
        )
    torch.distributed.barrier()
    out["mesh"] = _load_both(2, 2, f"{root}/mesh", f"{root}/flat-dcp")
    mesh = init_device_mesh("cpu", (4,))
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        storage.save({"p": partial}, f"{root}/partial", 1)
        out["partial"] = None
    except ValueError as e:
        out["partial"] = str(e)
    out["empty"] = _empty_boxes(root)
    out["back"] = _load_both(2, 2, f"{root}/nd", f"{root}/nd-dcp")
    out["flat_to_nd"] = _load_both(2, 2, f"{root}/flat", f"{root}/flat-dcp")
    out["job"] = _job(root, 2, 2, resume=False)
    return out


# Tensors whose grid cuts more than the first dim and leaves some rank's box empty: a (1, 4)
# row-parallel weight at dp=2 (dp rank 1 holds no row) and a (2, 3) tensor cut twice along its
# columns (rank 3 holds none).
EMPTY_BOXES = {
    "rows": ((1, 4), ("S0", "S1"), ("S1", "R")),
    "cols": ((2, 3), ("S1", "S1"), ("R", "S0")),
}  # name: (shape, the saved placements, the placements loaded into)


def _empty_box_state(mesh, which: int, fill: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    made = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    state = {}
    for name, (shape, *placements) in EMPTY_BOXES.items():
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 1
        t = distribute_tensor(
            full if fill else torch.zeros(shape), mesh, [made[p] for p in placements[which]]
        )
        state[name] = t
    return state


def _empty_boxes(root: str) -> dict:
    """Save the EMPTY_BOXES with storage and DCP; load both into the other placements."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    saved = _empty_box_state(mesh, 0, fill=True)
    out: dict = {"locals": {n: tuple(_local(t).shape) for n, t in saved.items()}}
    try:  # (raised on every rank alike: the spawn goes on to the other phases)
        storage.save(saved, f"{root}/empty", 1)
    except ValueError as e:
        return {**out, "error": str(e)}
    dcp.save(saved, checkpoint_id=f"{root}/empty-dcp")
    for which in (0, 1):
        mine, theirs = _empty_box_state(mesh, which, False), _empty_box_state(mesh, which, False)
        storage.load(mine, f"{root}/empty")
        dcp.load(theirs, checkpoint_id=f"{root}/empty-dcp")
        out[which] = [n for n in mine if not torch.equal(_local(mine[n]), _local(theirs[n]))]
    return out


GLOBAL_BATCH, SAMPLES = 12, 40


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 3, D, generator=g), torch.randn(SAMPLES, 3, D, generator=g)


def _batch(cursor: int, dp: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's samples of the step at ``cursor`` (all its micro-batches)."""
    from ftsdp.elastic import BatchGeometry, GlobalSampler

    geometry = BatchGeometry(global_batch=GLOBAL_BATCH, micro_batch=2, world_size=dp)
    sampler = GlobalSampler(SAMPLES, seed=3)
    index = [
        i
        for micro in range(geometry.share(dp_rank))
        for i in sampler.micro_batch(cursor, geometry, dp_rank, micro)
    ]
    x, y = _data()
    return x[index], y[index]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dp: int) -> torch.Tensor:
    # FSDP2 averages gradients over dp: scaled so that the step is the global batch's mean
    return (model(x) - y).square().mean(dim=(1, 2)).sum() * dp / GLOBAL_BATCH


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _job(root: str, dp: int, tp: int, resume: bool) -> dict:
    """The CheckpointManager job (see the module docstring); its step-5 parameters."""
    from ftsdp.checkpoint import CheckpointManager

    if dp * tp == 1:
        torch.manual_seed(0)
        model = _Net()  # unwrapped
        dp_rank = 0
    else:
        _build(dp, tp, step=False)
        model, dp_rank = _MODEL[0], _MODEL[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {}
    with CheckpointManager(f"{root}/job", model, opt, every_steps=2, keep_last=None) as ck:
        trainer = {"step": 0, "cursor": 0}
        if resume:
            info = ck.resume(trainer)
            assert info is not None
            out["resumed"] = (info.step, info.saved_world_size, dict(trainer))
        while trainer["step"] < 5:
            x, y = _batch(trainer["cursor"], dp, dp_rank)
            _loss(model, x, y, dp).backward()
            opt.step()
            opt.zero_grad()
            trainer = {"step": trainer["step"] + 1, "cursor": trainer["cursor"] + GLOBAL_BATCH}
            if ck.due(trainer["step"]) and trainer["step"] <= 4 and not resume:
                ck.save(trainer["step"], trainer)
        ck.wait()
    out["params"] = _params(model)
    return out


def _loads(rank: int, world: int, root: str, dp: int, tp: int) -> dict:
    return {
        "nd": _load_both(dp, tp, f"{root}/nd", f"{root}/nd-dcp"),
        "flat": _load_both(dp, tp, f"{root}/flat", f"{root}/flat-dcp"),
        "mesh": _load_both(dp, tp, f"{root}/mesh", f"{root}/flat-dcp"),
        "job": _job(root, dp, tp, resume=True),
    }


def _resume_alone(rank: int, world: int, root: str) -> dict:
    return {"job": _job(root, 1, 1, resume=True)}


@pytest.fixture(scope="module")
def runs(spawns) -> dict:
    """The three spawns' results (the W=4, 3 and 2 spawns this folder shares, see its
    conftest.py) and the resume on one rank, which runs in this process: a group of one rank
    over an in-memory store, with the variables a spawned rank has."""
    import torch.distributed as dist

    runs = {"root": spawns.nd_root, "saved": spawns.nd(4), "dp3": spawns.nd(3), "tp2": spawns.nd(2)}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            mp.setenv(name, value)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            runs["alone"] = [_resume_alone(0, 1, spawns.nd_root)]
        finally:
            dist.destroy_process_group()
    return runs


def test_the_saved_state_holds_every_2d_placement(runs) -> None:
    placements = set(runs["saved"][0]["placements"].values())
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in placements
    assert "(Shard(dim=0), Shard(dim=1))" in placements
    assert "(Shard(dim=0), Replicate())" in placements
    manifest = storage.catalog.read_manifest(f"{runs['root']}/nd")
    assert manifest.version == 5
    grids = {n for n, t in manifest.tensors.items() if t.grid is not None}
    assert (
        "model.blocks.0.down.weight" in grids
        and "optim.state.blocks.1.down.weight.exp_avg" in grids
    )
    assert manifest.tensors["model.blocks.0.down.weight"].grid == ((0, 16, 32), (0, 32, 64))


@pytest.mark.parametrize(
    ("spawn", "key"),
    [
        ("saved", "back"),
        ("saved", "flat_to_nd"),
        ("dp3", "nd"),
        ("dp3", "flat"),
        ("tp2", "nd"),
        ("tp2", "flat"),
        ("saved", "mesh"),
        ("dp3", "mesh"),
        ("tp2", "mesh"),
    ],
)
def test_every_reshard_loads_bitwise_what_dcp_loads(runs, spawn, key) -> None:
    for rank, r in enumerate(runs[spawn]):
        got = r[key]
        assert got["differ"] == [], (rank, got["differ"])
        assert got["zero"] == [], (rank, got["zero"])  # something was loaded everywhere


def test_column_sharded_targets_read_at_most_125_percent_of_what_they_need(runs) -> None:
    for spawn, key in [
        ("saved", "back"),
        ("tp2", "nd"),
        ("dp3", "nd"),
        ("saved", "flat_to_nd"),
        ("tp2", "flat"),
    ]:
        read = sum(r[key]["read"] for r in runs[spawn])
        needed = sum(r[key]["needed"] for r in runs[spawn])
        assert needed > 0 and read / needed <= 1.25, (spawn, key, read, needed)


def test_an_offline_reshard_to_the_mesh_writes_the_grids_of_its_save(runs) -> None:
    """``reshard(mesh=(2, 2))`` of the FSDP2-alone checkpoint gives every tensor the grid the
    dp x tp job's own save gave it (its loads are checked with the others above)."""
    nd = storage.catalog.read_manifest(f"{runs['root']}/nd")
    mesh = storage.catalog.read_manifest(f"{runs['root']}/mesh")
    assert mesh.version == 5 and mesh.world_size == 4
    assert {n: t.grid for n, t in mesh.tensors.items()} == {
        n: t.grid for n, t in nd.tensors.items()
    }
    assert mesh.tensors["model.blocks.0.down.weight"].grid == ((0, 16, 32), (0, 32, 64))


def test_one_process_reads_the_full_tensors(runs) -> None:
    full = runs["saved"][0]["full"]
    url = f"{runs['root']}/nd"
    loaded = storage.load_state_dict(url)
    lazy = storage.LazyStateDict(url)
    for name, t in full.items():
        assert torch.equal(loaded[name], t), name
        assert torch.equal(lazy[name], t), name


def test_a_grid_with_empty_boxes_saves_and_loads_what_dcp_loads(runs) -> None:
    """Some rank holds no part of a tensor whose grid is not row-major: every rank still names
    the grid (the save once failed on every rank, "rank 3 has ... grid=None"), and the
    checkpoint loads back, into other placements too, bitwise what DCP loads."""
    results = [r["empty"] for r in runs["saved"]]
    assert [r.get("error") for r in results] == [None] * 4
    assert {r["locals"]["rows"] for r in results} == {(1, 2), (0, 2)}  # dp rank 1: no row
    assert {r["locals"]["cols"] for r in results} >= {(2, 0)}  # rank 3: no column
    assert all(r[0] == [] and r[1] == [] for r in results), results
    loaded = storage.load_state_dict(f"{runs['root']}/empty")
    for name, (shape, *_) in EMPTY_BOXES.items():
        want = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 1
        assert torch.equal(loaded[name], want), name


def test_a_partial_dtensor_is_refused_with_a_clear_error(runs) -> None:
    message = runs["saved"][0]["partial"]
    assert message is not None and "Partial" in message and "redistribute" in message


def _reference(root: str) -> dict[str, torch.Tensor]:
    """Step 5 of an unwrapped model that loaded step 4 in this process (no manager involved)."""
    saved = storage.load_state_dict(f"{root}/job", step=4)
    torch.manual_seed(0)
    model = _Net()
    model.load_state_dict(
        {n[len("model.") :]: t for n, t in saved.items() if n.startswith("model.")}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    opt.load_state_dict(
        {
            "state": {
                i: {k: saved[f"optim.state.{n}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}
                for i, n in enumerate(names)
            },
            "param_groups": opt.state_dict()["param_groups"],
        }
    )
    x, y = _batch(4 * GLOBAL_BATCH, 1, 0)
    _loss(model, x, y, 1).backward()
    opt.step()
    return _params(model)


@pytest.mark.parametrize("spawn", ["saved", "dp3", "tp2", "alone"])
def test_the_job_resumed_at_any_layout_takes_the_unwrapped_references_step(runs, spawn) -> None:
    reference = _reference(runs["root"])
    for rank, r in enumerate(runs[spawn]):
        job = r["job"]
        if spawn != "saved":
            step, saved_world, trainer = job["resumed"]
            assert (step, saved_world) == (4, 4) and trainer == {
                "step": 4,
                "cursor": 4 * GLOBAL_BATCH,
            }
        for name, ref in reference.items():
            got = job["params"][name]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=f"{spawn} {rank} {name}")
