"""First-call benchmark: the obvious calls of ftsdp's storage and of DCP, each in fresh processes.

    python -m ftsdp.tools.bench_first_call --out docs/benchmarks.md

A newcomer's first checkpoint: an FSDP2 model (``fully_shard`` on every block, then the whole)
with AdamW state, ``--size-mb`` of it in all, on ``--world`` CPU ranks (gloo), saved with the
plain calls and nothing prepared: ``storage.save(state, url, step, async_save=True)`` against
``dcp.async_save(state, checkpoint_id=dir)``, ``storage.save(state, url, step)`` against
``dcp.save``, then loaded at ``--load-world`` ranks into an FSDP2 model sharded that way
(``storage.load`` against ``dcp.load``). The state is ``get_state_dict(model, optimizer)``, the
same dict for both libraries.

Every measurement runs in processes of its own, spawned for it (so every call is the first of
its process): async save (the time the call blocked, the slowest rank; then it waits for the
commit), sync save (GB/s of the whole state, barrier to barrier), and the load of that sync
save (GB/s; the files are in the page cache, as right after saving, unless ``--cold`` drops
them first), and the load of that save into one process that has no model, as for inference
(``storage.load_state_dict(url)`` against DCP's ``_load_state_dict_from_keys(checkpoint_id=dir)``,
the one DCP call that makes the tensors itself; GB/s). Each round runs both libraries, alternating which goes first; the table holds the
median over ``--rounds`` rounds, the range (min-max), and the median of the per-round ratios
ftsdp/DCP. Every load is checked against the values saved (every saved tensor holds a pattern
of its global element index). ``--out FILE`` writes the table into FILE's "First call"
section, ``--json FILE`` its numbers into the ``first_call`` entry of a JSON results file.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ftsdp.testing import run_ranks
from ftsdp.tools import _bench_json
from ftsdp.tools._markdown import replace_section

TITLE = "## First call"
LIBS = ("ftsdp", "dcp")
ROWS = (  # (key, label, better when higher)
    ("async_blocking_s", "async save: blocking s", False),
    ("async_cpu_s", "async save: CPU s of the process while blocked", False),
    ("async_total_s", "async save: until committed s", False),
    ("save_gbps", "sync save GB/s", True),
    ("load_gbps", "load {saved} -> {loaded} GB/s", True),
    ("infer_gbps", "one-process load of everything (inference) GB/s", True),
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=400, help="model + AdamW state, all ranks (MB)")
    p.add_argument("--dim", type=int, default=512, help="model width")
    p.add_argument("--world", type=int, default=2, help="ranks that save")
    p.add_argument("--load-world", type=int, default=3, help="ranks that load")
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians over them)")
    p.add_argument("--cold", action="store_true", help="drop the files from the page cache first")
    p.add_argument("--dir", default=None, help="parent of the temporary checkpoint directory")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per spawned run")
    p.add_argument("--out", default=None, help="Markdown file whose First call section to write")
    p.add_argument("--json", default=None, help="JSON results file whose first_call entry to write")
    return p.parse_args(argv)


# -- per rank ---------------------------------------------------------------------------------------


def blocks_for(cfg: dict[str, Any]) -> int:
    """MLP blocks (a LayerNorm, an up and a down projection) whose fp32 parameters with AdamW's
    two moments hold ``size_mb`` (bench_nd's model too)."""
    d = cfg["dim"]
    per_block = (2 * 4 * d * d + 4 * d + d + 2 * d) * 4 * 3
    return max(1, round(cfg["size_mb"] * 1e6 / per_block))


def _model_and_state(world: int, cfg: dict[str, Any], fill: bool) -> tuple[Any, Any, dict]:
    """An FSDP2 model of ``blocks_for`` blocks with AdamW state after one step, and its
    ``get_state_dict``; with ``fill`` every tensor then holds its pattern (``_pattern``)."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    d = cfg["dim"]
    blocks = [
        nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        for _ in range(blocks_for(cfg))
    ]
    model = nn.Sequential(*blocks)
    mesh = init_device_mesh("cpu", (world,))
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, d)).sum().backward()  # the optimizer's state exists after a step
    opt.step()
    opt.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if fill:
        with torch.no_grad():
            for i, (_, t) in enumerate(_leaves(state)):
                local, start = _local_and_start(t)
                local.copy_(_pattern(i, start, local.numel()).view(local.shape))
    return model, opt, state


def _leaves(state: dict) -> list[tuple[str, Any]]:
    """(name, tensor) of every tensor of the state, in a fixed order."""
    import torch

    out: list[tuple[str, Any]] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(f"{prefix}.{k}", node[k])
        elif isinstance(node, torch.Tensor):
            out.append((prefix, node))

    walk("", state)
    return out


def _local_and_start(t: Any) -> tuple[Any, int]:
    """A tensor's local part and the global flat index of its first element."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, 0
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    row = math.prod(t.shape[1:])
    return t.to_local(), (offsets[0] * row if offsets else 0)


def _pattern(seed: int, start: int, n: int) -> Any:
    """Deterministic fp32 values of the global flat elements ``[start, start + n)``."""
    import torch

    idx = torch.arange(start, start + n, dtype=torch.int64)
    return ((idx * 40503 + seed * 977) % 65521).to(torch.float32)


def _check(state: dict) -> int:
    """Raise unless every tensor of ``state`` holds its pattern; the tensors checked."""
    import torch

    leaves = _leaves(state)
    for i, (name, t) in enumerate(leaves):
        local, start = _local_and_start(t)
        if not torch.equal(local.reshape(-1), _pattern(i, start, local.numel())):
            raise AssertionError(f"{name}: the loaded values differ from the saved ones")
    return len(leaves)


def _nbytes(state: dict) -> int:
    """Bytes of the whole state's tensors (all ranks)."""
    return sum(t.numel() * t.element_size() for _, t in _leaves(state))


def _slowest(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _cpu_seconds() -> float:
    """CPU seconds (user + system) this process has used so far, all its threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def save_rank(rank: int, world: int, cfg: dict[str, Any], lib: str, kind: str) -> dict:
    """One first call of ``lib`` in this fresh process: ``kind`` "async" or "sync"."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ftsdp import storage

    _, _, state = _model_and_state(world, cfg, fill=True)
    path = os.path.join(cfg["root"], f"{lib}-{kind}")
    group = dist.new_group(backend="gloo") if lib == "dcp" and kind == "async" else None
    dist.barrier()
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    if kind == "async":
        if lib == "dcp":  # on a gloo group of its own, as DCP recommends
            future: Any = dcp.async_save(state, checkpoint_id=path, process_group=group)
            blocking, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
            future.result()
        else:
            handle = storage.save(state, path, 1, async_save=True)
            blocking, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
            handle.wait()
    elif lib == "dcp":
        blocking = cpu = 0.0
        dcp.save(state, checkpoint_id=path)
    else:
        blocking = cpu = 0.0
        storage.save(state, path, 1)
    dist.barrier()
    total = time.perf_counter() - t0
    return {
        "blocking": _slowest(blocking),
        "cpu": _slowest(cpu),
        "total": total,
        "bytes": _nbytes(state),
        "names": [name for name, _ in _leaves(state)],
    }


def load_rank(rank: int, world: int, cfg: dict[str, Any], lib: str) -> dict:
    """The first load of ``lib``'s sync save in this fresh process, at ``world`` ranks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ftsdp import storage

    _, _, state = _model_and_state(world, cfg, fill=False)
    path = os.path.join(cfg["root"], f"{lib}-sync")
    if cfg["cold"] and rank == 0:
        from ftsdp.tools._bench_ranks import drop_cache

        drop_cache(path)
    dist.barrier()
    t0 = time.perf_counter()
    if lib == "dcp":
        dcp.load(state, checkpoint_id=path)
    else:
        storage.load(state, path)
    dist.barrier()
    total = time.perf_counter() - t0
    return {"total": total, "bytes": _nbytes(state), "checked": _check(state)}


def infer_rank(rank: int, world: int, cfg: dict[str, Any], lib: str, names: list[str]) -> dict:
    """The first one-process load of everything in ``lib``'s sync save, in this fresh process,
    which builds no model: the tensors come from the load. ``names``: the saved state's
    ``_leaves`` names, in order (what ``_pattern`` was seeded with)."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from ftsdp import storage

    path = os.path.join(cfg["root"], f"{lib}-sync")
    if cfg["cold"]:
        from ftsdp.tools._bench_ranks import drop_cache

        drop_cache(path)
    t0 = time.perf_counter()
    if lib == "dcp":
        loaded = _load_state_dict_from_keys(checkpoint_id=path)
    else:
        loaded = storage.load_state_dict(path)
    total = time.perf_counter() - t0
    # ftsdp's keys are the nested names joined by "."; DCP gives the nested dict back
    flat = loaded if lib == "ftsdp" else {name[1:]: t for name, t in _leaves(loaded)}
    nbytes = 0
    for i, name in enumerate(names):
        t = flat[name[1:]]
        if not torch.equal(t.reshape(-1), _pattern(i, 0, t.numel())):
            raise AssertionError(f"{name}: the loaded values differ from the saved ones")
        nbytes += t.numel() * t.element_size()
    return {"total": total, "bytes": nbytes, "checked": len(names)}


# -- the parent -------------------------------------------------------------------------------------


_HERE = "ftsdp.tools.bench_first_call"  # the ranks import the functions by name


def run_round(cfg: dict[str, Any], order: tuple[str, ...], timeout: float) -> dict[str, dict]:
    """One round: each library's async save, sync save and load, each in fresh processes."""
    out: dict[str, dict] = {}
    for lib in order:
        a = run_ranks(f"{_HERE}:save_rank", cfg["world"], cfg, lib, "async", timeout=timeout)[0]
        s = run_ranks(f"{_HERE}:save_rank", cfg["world"], cfg, lib, "sync", timeout=timeout)[0]
        ld = run_ranks(f"{_HERE}:load_rank", cfg["load_world"], cfg, lib, timeout=timeout)[0]
        inf = run_ranks(f"{_HERE}:infer_rank", 1, cfg, lib, s["names"], timeout=timeout)[0]
        out[lib] = {
            "async_blocking_s": a["blocking"],
            "async_cpu_s": a["cpu"],
            "async_total_s": a["total"],
            "save_gbps": s["bytes"] / s["total"] / 1e9,
            "load_gbps": ld["bytes"] / ld["total"] / 1e9,
            "infer_gbps": inf["bytes"] / inf["total"] / 1e9,
            "bytes": s["bytes"],
            "checked": ld["checked"],
            "infer_checked": inf["checked"],
        }
        shutil.rmtree(os.path.join(cfg["root"], f"{lib}-async"), ignore_errors=True)
    return out


def summarize(rounds: list[dict[str, dict]]) -> dict[str, dict[str, Any]]:
    """Per row: each library's median and range over the rounds, and the median (and range)
    of the per-round ratios ftsdp/DCP."""
    rows: dict[str, dict[str, Any]] = {}
    for key, _, _ in ROWS:
        row: dict[str, Any] = {}
        for lib in LIBS:
            row[lib] = spread([r[lib][key] for r in rounds])
        ratios = [r["ftsdp"][key] / r["dcp"][key] for r in rounds]
        row["ratio"] = spread(ratios)
        row["ratios"] = ratios
        rows[key] = row
    return rows


def spread(values: list[float]) -> dict[str, float]:
    """The median and the range of ``values`` (bench_nd's too)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread_cell(v: dict[str, float], fmt: str) -> str:
    """A :func:`spread` as a table cell: ``median (min-max)``."""
    return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"


def environment(when: str) -> str:
    """torch, the CPUs, their load average ``when`` (``start``, ``end``), the format version."""
    import torch

    from ftsdp import storage

    return (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1-minute load average "
        f"{os.getloadavg()[0]:.1f} at the {when}: other work shares them; format version "
        f"{storage.format.FORMAT_VERSION}"
    )


def render(rows: dict[str, dict[str, Any]], cfg: dict[str, Any], command: str, env: str) -> str:
    """The Markdown section: the command, the table, the verdicts."""
    gb = cfg["bytes"] / 1e9

    lines = [
        TITLE,
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; {cfg['rounds']} rounds, every "
        f"measurement in fresh processes; {gb:.3f} GB of FSDP2 + AdamW state saved at "
        f"{cfg['world']} ranks, loaded at {cfg['load_world']}"
        f"{', cache dropped' if cfg['cold'] else ', files in the page cache'}; {env})",
        "",
        "Median over the rounds (min-max); ratio: the median of the per-round ftsdp/DCP ratios.",
        "",
        "| measurement | ftsdp (plain call) | DCP | ftsdp / DCP | per round |",
        "|---|---|---|---|---|",
    ]
    for key, label, _ in ROWS:
        fmt = ".3f" if key.endswith("_s") else ".2f"
        r = rows[key]
        name = label.format(saved=cfg["world"], loaded=cfg["load_world"])
        per = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {name} | {spread_cell(r['ftsdp'], fmt)} | {spread_cell(r['dcp'], fmt)} | "
            f"{spread_cell(r['ratio'], '.2f')}x | {per} |"
        )
    lines.append("")
    for key, label, higher in ROWS:
        if key in ("async_total_s", "async_cpu_s"):  # informational
            continue
        ratio = rows[key]["ratio"]["median"]
        met = ratio >= 1 if higher else ratio <= 1
        name = label.format(saved=cfg["world"], loaded=cfg["load_world"])
        goal = "at least DCP's" if higher else "at most DCP's"
        lines.append(f"- {name}: {goal}: {'MET' if met else 'MISSED'} ({ratio:.2f}x)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds} must be >= 1")
    command = "python -m ftsdp.tools.bench_first_call " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    root = tempfile.mkdtemp(prefix="bench-first-call-", dir=args.dir)
    cfg = {
        "size_mb": args.size_mb,
        "dim": args.dim,
        "world": args.world,
        "load_world": args.load_world,
        "cold": args.cold,
        "rounds": args.rounds,
        "root": root,
    }
    try:
        rounds = []
        for r in range(args.rounds):
            order = LIBS if r % 2 == 0 else LIBS[::-1]
            rounds.append(run_round(cfg, order, args.timeout))
            for lib in LIBS:
                shutil.rmtree(os.path.join(root, f"{lib}-sync"), ignore_errors=True)
            print(f"round {r + 1}/{args.rounds}: {rounds[-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cfg["bytes"] = rounds[0]["ftsdp"]["bytes"]
    rows = summarize(rounds)
    env = environment("end")
    text = render(rows, cfg, command.strip(), env)
    print(text)
    if args.out:
        replace_section(args.out, text, TITLE)
    if args.json:
        entry = {"bytes": cfg["bytes"], "rounds": rounds, "rows": rows}
        _bench_json.write_entry(args.json, "first_call", entry, command.strip(), env)
    return rows


if __name__ == "__main__":
    main()
