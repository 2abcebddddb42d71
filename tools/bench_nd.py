"""N-D benchmark: FSDP2 + tensor parallel state saved and loaded resharded, ftsdp against DCP.

    python -m ftsdp.tools.bench_nd --out docs/benchmarks.md --json docs/benchmarks.json

A model of blocks, each a LayerNorm, an up projection (``ColwiseParallel``) and a down
projection (``RowwiseParallel``) over the tp dim of a ``--save-mesh`` dp x tp DeviceMesh (2x2:
W=4 gloo CPU ranks), ``fully_shard``-ed over its dp dim, with AdamW state after one step: the
state (``get_state_dict(model, opt)`` as ``{"model", "optim"}``, about ``--size-mb`` in all)
holds ``(_StridedShard(0), Shard(0))`` row slabs, ``(Shard(0), Shard(1))`` boxes, ``(Shard(0),
Replicate())`` biases and 1-D ``Shard(0)`` norms. One spawn saves it every round with each
engine, the engines taking turns to go first: ``storage.save(state, url, step)`` against
``dcp.save(state, checkpoint_id=dir)``, and ``storage.save(..., async_save=True)`` against
``dcp.async_save`` (on a gloo group of its own, as DCP recommends; the time the call blocked,
and until committed). ftsdp saves to one root, a step a round, as a training job does (the
first save to a root makes storage's own group and snapshot memory: a warm-up round's); DCP to
a directory a save. Then the raw floor, every rank writing its share of the same bytes to a
file of its own with plain writes and an fsync, all at once. Then, for each layout of
``--loads`` (3x1: W=3 with FSDP2 alone; 1x2: W=2 with tp=2), a spawn builds the same model
sharded that way and loads the last round's two checkpoints into it every round, each engine's
load with the checkpoint's files dropped from the page cache first and then again with them
in the cache (warm), and the raw floor: every rank reading its share of the files of ftsdp's
checkpoint, whole, cache dropped. Before each load the target is zeroed; after each round the two targets
must be bitwise equal, tensor by tensor, and none may be left all zero; in the first round every
tensor's float64 sum must match the saved one: the benchmark fails otherwise.

Every measurement is the wall time of the collective call, barrier before and after (the
slowest rank); ``--warmup`` untimed rounds run first (the first calls of a process: see "First
call"). GB/s: bytes of the whole state over that time. The table holds the median over
``--rounds`` rounds (min-max) and the median (min-max) of the per-round ratios ftsdp/DCP, and
ftsdp's ``LoadResult.bytes_read / bytes_needed`` summed over the ranks. ``--out FILE`` writes it
into FILE's "N-D layouts (FSDP2 + TP)" section, ``--json FILE`` its numbers into the ``nd``
entry of a JSON results file.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from functools import partial
from typing import Any

from ftsdp.testing import run_ranks
from ftsdp.tools import _bench_json
from ftsdp.tools._markdown import replace_section
from ftsdp.tools.bench_first_call import blocks_for, environment, spread, spread_cell

TITLE = "## N-D layouts (FSDP2 + TP)"
ENGINES = ("ftsdp", "dcp")
_HERE = "ftsdp.tools.bench_nd"  # the ranks import their functions by name


def _mesh(text: str) -> tuple[int, int]:
    """``"DPxTP"`` as ``(dp, tp)``."""
    try:
        dp, tp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DPxTP, e.g. 2x2") from None
    if dp < 1 or tp < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: dp and tp must be >= 1")
    return dp, tp


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=300, help="model + AdamW state, all ranks (MB)")
    p.add_argument("--dim", type=int, default=1024, help="model width (hidden: 4x)")
    p.add_argument("--save-mesh", type=_mesh, default=(2, 2), help="DPxTP of the save")
    p.add_argument("--loads", default="3x1,1x2", help="DPxTP layouts to load into, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (medians over them)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--dir", default=None, help="parent of the temporary checkpoint directory")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned run")
    p.add_argument("--out", default=None, help="Markdown file whose N-D section to write")
    p.add_argument("--json", default=None, help="JSON results file whose nd entry to write")
    args = p.parse_args(argv)
    args.loads = [_mesh(x) for x in args.loads.split(",") if x.strip()]
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    if args.dim % 2:
        p.error("--dim must be even")
    return args


# -- the model and its state (per rank) -------------------------------------------------------------


def build(dp: int, tp: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The model on a dp x tp mesh (tp=1: FSDP2 alone over a 1-D mesh) after one AdamW step:
    ``{"model": ..., "optim": ...}`` of ``get_state_dict``. Every layout starts from the same
    seeded weights."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    d = cfg["dim"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(0)
    blocks = [Block() for _ in range(blocks_for(cfg))]
    model = nn.Sequential(*blocks)
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for b in blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (dp,))
    for b in blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 3, d, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Dotted name -> tensor (DTensor or plain) of every tensor leaf of ``state``."""
    import torch

    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(f"{prefix}.{i}", v)
        elif isinstance(node, torch.Tensor):
            out[prefix] = node

    walk("", state)
    return out


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _zero(state: dict[str, Any]) -> None:
    for t in tensors(state).values():
        _local(t).zero_()


def nbytes(state: dict[str, Any]) -> int:
    """Bytes of the whole state's tensors (every element once, whatever the layout)."""
    return sum(t.numel() * t.element_size() for t in tensors(state).values())


def sums(state: dict[str, Any]) -> dict[str, float]:
    """Each tensor's float64 sum over its global elements (collective over the world: each
    rank sums its local part, divided by the number of ranks that hold the same part)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    named = tensors(state)
    local = []
    for t in named.values():
        if isinstance(t, DTensor):  # the mesh may span part of the world (FSDP's dp dim)
            copies = dist.get_world_size() // t.device_mesh.size()
            copies *= math.prod(
                n
                for n, p in zip(t.device_mesh.shape, t.placements, strict=True)
                if isinstance(p, Replicate)
            )
        else:  # a plain tensor: the same on every rank
            copies = dist.get_world_size()
        local.append(_local(t).to(torch.float64).sum() / copies)
    total = torch.stack(local) if local else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(total)
    return dict(zip(named, total.tolist(), strict=True))


def compare(mine: dict[str, Any], theirs: dict[str, Any]) -> int:
    """Raise AssertionError naming the tensors whose local parts differ between the two loaded
    states (bitwise) or that a load left all zero; the tensors compared."""
    import torch

    a, b = tensors(mine), tensors(theirs)
    if a.keys() != b.keys():
        raise AssertionError(f"different tensors: {sorted(a.keys() ^ b.keys())}")
    differ = [n for n in a if not torch.equal(_local(a[n]), _local(b[n]))]
    zero = [n for n in a if _local(a[n]).numel() and not _local(a[n]).any()]
    if differ or zero:
        raise AssertionError(
            f"ftsdp and DCP loaded different values into {differ}; left all zero: {zero}"
        )
    return len(a)


def check_sums(state: dict[str, Any], saved: dict[str, float]) -> None:
    """Raise AssertionError unless each tensor's sum is the saved one (to float64 rounding)."""
    got = sums(state)
    bad = [n for n, v in saved.items() if not math.isclose(got[n], v, rel_tol=1e-9, abs_tol=1e-6)]
    if bad or got.keys() != saved.keys():
        raise AssertionError(f"loaded sums differ from the saved ones: {bad}")


# -- the timed phases (per rank) --------------------------------------------------------------------


def _raw_write(path: str, n: int) -> None:
    """``n`` bytes to ``path`` in 8 MiB writes, then fsync: the floor of a save."""
    chunk = 8 << 20
    buf = memoryview(os.urandom(min(chunk, max(n, 1))))
    with open(path, "wb", buffering=0) as f:
        for off in range(0, n, len(buf)):
            f.write(buf[: min(len(buf), n - off)])
        os.fsync(f.fileno())


def _raw_read(paths: list[str]) -> None:
    """Read the files ``paths`` whole, in 8 MiB reads: the floor of a load."""
    buf = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def save_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every round: each engine's sync and async save of the state (the order alternating) and
    the raw floor; rank 0's record of the slowest rank's times, per round."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ftsdp import storage
    from ftsdp.tools._bench_ranks import _max, _timed

    dp, tp = cfg["save_mesh"]
    state = build(dp, tp, cfg)
    total = nbytes(state)
    saved_sums = sums(state)
    async_group = dist.new_group(backend="gloo")  # DCP's background save: a group of its own
    root = cfg["root"]
    out: dict[str, list[float]] = {}

    # ftsdp saves every round to one root, a step each, as a training job does (its lane, with
    # its own group and snapshot memory, made at the first save); DCP to a directory each.
    def storage_async(step: int) -> float:
        t0 = time.perf_counter()
        handle = storage.save(state, f"{root}/ftsdp-async", step, async_save=True)
        blocking = time.perf_counter() - t0
        handle.wait()
        return blocking

    def dcp_async(step: int) -> float:
        t0 = time.perf_counter()
        path = f"{root}/dcp-async-{step}"
        future = dcp.async_save(state, checkpoint_id=path, process_group=async_group)
        blocking = time.perf_counter() - t0
        assert isinstance(future, Future)  # without an async stager: one future
        future.result()
        return blocking

    def sync(engine: str, step: int) -> None:
        if engine == "ftsdp":
            storage.save(state, f"{root}/ftsdp", step)
        else:
            dcp.save(state, checkpoint_id=f"{root}/dcp-{step}")

    for i in range(cfg["warmup"] + cfg["rounds"]):
        timed = i >= cfg["warmup"]
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        got: dict[str, float] = {}
        for engine in order:
            got[f"{engine}.save_s"], _ = _timed(partial(sync, engine, i))
            start = storage_async if engine == "ftsdp" else dcp_async
            dt, blocking = _timed(partial(start, i))
            got[f"{engine}.async_total_s"] = dt
            got[f"{engine}.async_blocking_s"] = _max(blocking)
        raw = f"{root}/raw-{rank}.bin"
        got["raw.save_s"], _ = _timed(partial(_raw_write, raw, total // world))
        os.remove(raw)
        dist.barrier()
        if rank == 0:  # DCP's last sync save is the one the loads read
            shutil.rmtree(f"{root}/dcp-async-{i}", ignore_errors=True)
            if i:
                shutil.rmtree(f"{root}/dcp-{i - 1}", ignore_errors=True)
        dist.barrier()
        if timed:
            for k, v in got.items():
                out.setdefault(k, []).append(v)
    return {"times": out, "bytes": total, "sums": saved_sums, "tensors": len(saved_sums)}


def load_rank(
    rank: int, world: int, cfg: dict[str, Any], layout: tuple[int, int], saved: dict[str, float]
) -> dict[str, Any]:
    """Every round: each engine loads its checkpoint into the model sharded as ``layout``, from
    the disk (page cache dropped) then warm; the two targets checked bitwise after each round,
    and against the saved sums in the first."""
    import torch.distributed.checkpoint as dcp

    from ftsdp import storage
    from ftsdp.tools._bench_ranks import _sum, _timed

    mine, theirs = build(*layout, cfg), build(*layout, cfg)
    last = cfg["warmup"] + cfg["rounds"] - 1
    paths = {"ftsdp": f"{cfg['root']}/ftsdp", "dcp": f"{cfg['root']}/dcp-{last}"}
    out: dict[str, list[float]] = {}
    checked = 0

    def load(engine: str) -> Any:
        if engine == "ftsdp":
            return storage.load(mine, paths["ftsdp"], last)
        dcp.load(theirs, checkpoint_id=paths["dcp"])
        return None

    for i in range(cfg["warmup"] + cfg["rounds"]):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        got: dict[str, float] = {}
        for engine in order:
            target = mine if engine == "ftsdp" else theirs
            _zero(target)
            got[f"{engine}.load_s"], result = _timed(partial(load, engine), paths[engine])
            if result is not None:
                read, needed = _sum(result.bytes_read), _sum(result.bytes_needed)
                got["ftsdp.read_ratio"] = read / needed
            _zero(target)
            got[f"{engine}.warm_load_s"], _ = _timed(partial(load, engine))
        step_dir = f"{paths['ftsdp']}/step-{last}"  # the files of ftsdp's step, a share a rank
        share = [os.path.join(step_dir, n) for n in sorted(os.listdir(step_dir))[rank::world]]
        got["raw.load_s"], _ = _timed(partial(_raw_read, share), paths["ftsdp"])
        checked = compare(mine, theirs)
        if i == 0:
            check_sums(mine, saved)
        if i >= cfg["warmup"]:
            for k, v in got.items():
                out.setdefault(k, []).append(v)
    return {"times": out, "checked": checked}


# -- the parent -------------------------------------------------------------------------------------


def _name(layout: tuple[int, int]) -> str:
    return f"{layout[0]}x{layout[1]}"


def rows(cfg: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """The table's rows: ``(key, label, unit, higher is better)`` (None: no verdict)."""
    save = _name(cfg["save_mesh"])
    out: list[tuple[str, str, str, bool | None]] = [
        ("save", f"save at {save}, GB/s", "gbps", True),
        ("async_blocking", f"async save at {save}: blocking s", "s", False),
        ("async_total", f"async save at {save}: until committed s", "s", None),
    ]
    for layout in cfg["loads"]:
        name = f"{save} -> {_name(layout)}"
        out.append((f"load {_name(layout)}", f"load {name}, cache dropped, GB/s", "gbps", True))
        out.append((f"warm {_name(layout)}", f"load {name}, warm cache, GB/s", "gbps", True))
    return out


def per_round(res: dict[str, Any], key: str) -> dict[str, list[float]]:
    """Each engine's per-round values of the row ``key`` (GB/s for rates, else seconds)."""
    total = res["bytes"]
    times = res["save"]["times"]
    if key == "save":
        return {e: [total / s / 1e9 for s in times[f"{e}.save_s"]] for e in ENGINES}
    if key.startswith("async_"):
        return {e: times[f"{e}.{key}_s"] for e in ENGINES}
    kind, layout = key.split()
    lt = res["loads"][layout]["times"]
    field = "load_s" if kind == "load" else "warm_load_s"
    return {e: [total / s / 1e9 for s in lt[f"{e}.{field}"]] for e in ENGINES}


def summarize(res: dict[str, Any], cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per row: each engine's median and range over the rounds, the per-round ratios
    ftsdp/DCP with their median and range."""
    out: dict[str, dict[str, Any]] = {}
    for key, _, _, _ in rows(cfg):
        values = per_round(res, key)
        ratios = [a / b for a, b in zip(values["ftsdp"], values["dcp"], strict=True)]
        out[key] = {e: spread(values[e]) for e in ENGINES}
        out[key]["ratio"] = spread(ratios)
        out[key]["ratios"] = ratios
    return out


def render(
    summary: dict[str, dict[str, Any]], res: dict[str, Any], cfg: dict[str, Any], command: str
) -> str:
    """The Markdown section: the command, the table, the verdicts."""

    save = _name(cfg["save_mesh"])
    lines = [
        TITLE,
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; {cfg['rounds']} round{'s' * (cfg['rounds'] != 1)} after "
        f"{cfg['warmup']} untimed, the engines alternating; {res['bytes'] / 1e9:.3f} GB of FSDP2 "
        f"+ TP + AdamW state ({res['tensors']} tensors) saved at dp x tp = {save} "
        f"(W={math.prod(cfg['save_mesh'])}) into {cfg['parent']}; {res['environment']})",
        "",
        "Median over the rounds (min-max); ftsdp / DCP: the median (min-max) of the per-round "
        "ratios. Every load was checked: ftsdp's and DCP's targets bitwise equal, tensor by "
        "tensor, in every round. Bytes read / needed: ftsdp's `LoadResult`, summed over the "
        "ranks; above 1 where a rank's slice of a saved cell starts or ends inside a checksum "
        "block (1 MiB by default), which it reads whole to verify it. Raw floors: every rank "
        "writes its share of the state's bytes to a file of its own at once, in 8 MiB writes, "
        "then fsync; every rank of a load's layout reads its share of the files of ftsdp's "
        "checkpoint (whole files, 8 MiB reads) at once, after they were dropped from the page "
        "cache.",
        "",
        "| measurement | ftsdp | DCP | ftsdp / DCP |",
        "|---|---|---|---|",
    ]
    for key, label, unit, _ in rows(cfg):
        fmt = ".2f" if unit == "gbps" else ".3f"
        r = summary[key]
        lines.append(
            f"| {label} | {spread_cell(r['ftsdp'], fmt)} | {spread_cell(r['dcp'], fmt)} | "
            f"{spread_cell(r['ratio'], '.2f')}x |"
        )
    for layout in cfg["loads"]:
        ratio = spread(res["loads"][_name(layout)]["times"]["ftsdp.read_ratio"])
        lines.append(
            f"| bytes read / needed, {save} -> {_name(layout)} | {ratio['median']:.3f} | - | - |"
        )
    raw = [res["bytes"] / s / 1e9 for s in res["save"]["times"]["raw.save_s"]]
    lines.append(
        f"| raw floor: the same bytes written with plain file writes, GB/s | "
        f"{spread_cell(spread(raw), '.2f')} | | |"
    )
    for layout in cfg["loads"]:
        times = res["loads"][_name(layout)]["times"]["raw.load_s"]
        raw = [res["bytes"] / s / 1e9 for s in times]
        lines.append(
            f"| raw floor: ftsdp's files read at W={math.prod(layout)}, cache dropped, GB/s | "
            f"{spread_cell(spread(raw), '.2f')} | | |"
        )
    lines.append("")
    for key, label, _, higher in rows(cfg):
        if higher is None:
            continue
        ratio = summary[key]["ratio"]["median"]
        met = ratio >= 1 if higher else ratio <= 1
        goal = "at least DCP's speed" if higher else "at most DCP's"
        lines.append(f"- {label}: {goal}: {'MET' if met else 'MISSED'} ({ratio:.2f}x)")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The spawned phases: ``(results, cfg)``; the data lives in a temporary directory."""
    parent = args.dir or tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="bench-nd-", dir=parent)
    cfg: dict[str, Any] = {
        "size_mb": args.size_mb,
        "dim": args.dim,
        "save_mesh": args.save_mesh,
        "loads": args.loads,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "root": root,
        "parent": parent,
    }
    res: dict[str, Any] = {"environment": environment("start"), "loads": {}}
    try:
        t0 = time.perf_counter()
        world = math.prod(args.save_mesh)
        saved = run_ranks(f"{_HERE}:save_rank", world, cfg, timeout=args.timeout)[0]
        res.update(save=saved, bytes=saved["bytes"], tensors=saved["tensors"])
        print(f"save phase at W={world}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        for layout in args.loads:
            t0 = time.perf_counter()
            world = math.prod(layout)
            res["loads"][_name(layout)] = run_ranks(
                f"{_HERE}:load_rank", world, cfg, layout, saved["sums"], timeout=args.timeout
            )[0]
            print(f"load phase {_name(layout)}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res, cfg


def json_entry(summary: dict[str, Any], res: dict[str, Any], cfg: dict[str, Any]) -> dict:
    """The ``nd`` entry of the JSON results: sizes, layouts, the rows and the raw times."""
    return {
        "bytes": res["bytes"],
        "save_mesh": _name(cfg["save_mesh"]),
        "loads": [_name(x) for x in cfg["loads"]],
        "rounds": cfg["rounds"],
        "tensors": res["tensors"],
        "checked": {k: v["checked"] for k, v in res["loads"].items()},
        "rows": summary,
        "save_times": res["save"]["times"],
        "load_times": {k: v["times"] for k, v in res["loads"].items()},
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse(argv)
    command = "python -m ftsdp.tools.bench_nd " + " ".join(sys.argv[1:] if argv is None else argv)
    command = command.strip()
    res, cfg = run(args)
    summary = summarize(res, cfg)
    text = render(summary, res, cfg, command)
    print(text)
    if args.out:
        replace_section(args.out, text, TITLE)
        print(f"wrote the {TITLE[3:]} section of {args.out}")
    if args.json:
        entry = json_entry(summary, res, cfg)
        _bench_json.write_entry(args.json, "nd", entry, command, res["environment"])
        print(f"wrote the nd entry of {args.json}")
    return summary


if __name__ == "__main__":
    main()
