"""Snapshot benchmark: what checkpointing every 2 steps costs a training loop, side by side.

    python -m ftsdp.tools.bench_snapshot --out docs/benchmarks.md

The built-in GPT (the main job's default shape) trains on ``--world`` CPU ranks (gloo) with
AdamW, in one spawned run, under each engine and way of checkpointing:

- ``ftsdp.FSDP`` without saving, and with ``CheckpointManager`` saving every ``--every`` steps:
  deferred copy (the default: ``save`` returns before copying, ``optimizer.step()`` waits for the
  background copy) and staged copy (``defer_copy=False``: ``save`` copies before it returns);
  and its memory tier alone (no durable save due: ``save_to_memory`` at the same points, keeping
  2 steps, whose saves overwrite the objects of the step they retire);
- torch FSDP2 (``fully_shard``) without saving, with ``dcp.async_save`` every ``--every`` steps
  (on a gloo group of its own, as DCP recommends; a save waits for the previous one's future,
  as a loop must), and with ``CheckpointManager`` (deferred copy).

Checkpoints go to ``--dir`` (default ``/dev/shm``: memory, so the figures are the saves' CPU cost,
not a disk's). Every configuration runs ``--steps`` steps per round, ``--rounds`` rounds, the
saving configurations of a round in a random order (seeded; a fixed rotation gave each
configuration the same predecessor, whose leftovers it then always paid for), each right after
a round of the same engine without saving, its pair, and every round after a garbage
collection; a round is timed barrier to barrier (the slowest rank). It saves at its start and after every ``--every`` steps but the last, so each save has
``--every`` steps of training to overlap inside the round, as in a long run, and it ends after
its last save has committed, so background work is not left to the next configuration. (A
round that saved after its last step would time that save's whole latency with nothing to
overlap: about one save's latency per round too much, for every way of saving.)

Step time is the median over rounds. Overhead is against the same engine without saving,
paired by round: the median over rounds of a round's step time over that of the unsaved round
right before it (the two run back to back, 2 to 3 seconds, so the drift of a shared machine's
speed, often larger than the overhead, mostly cancels; paired with an unsaved round up to six
rounds away, the middle half of the per-round overheads spanned 9 to 17 points). Blocking is the time ``save`` /
``async_save`` kept the caller, the first save apart (``CheckpointManager.resume`` prepared
the deferred saves before it: storage's own group and the snapshot memory; DCP has no such
call). ``fence wait`` is the time ``optimizer.step()`` waited for a snapshot, per save. ``--only ftsdp/storage`` (comma-separated) runs only those saving configurations, with their
engines' unsaved rounds: more rounds of one configuration in the same time. Prints
a table; ``--out FILE`` writes it into FILE's "Snapshots" section, ``--json FILE`` its numbers
into the ``snapshot`` entry of a JSON results file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from ftsdp.tools import _bench_json
from ftsdp.tools._markdown import replace_section
from ftsdp.tools.bench_engine import model_config

CONFIGS = (
    ("ftsdp", "none"),
    ("ftsdp", "storage"),
    ("ftsdp", "storage-staged"),
    ("ftsdp", "memory"),
    ("fsdp2", "none"),
    ("fsdp2", "dcp"),
    ("fsdp2", "storage"),
)
LABEL = {
    "none": "no saves",
    "storage": "CheckpointManager (deferred copy)",
    "storage-staged": "CheckpointManager (staged copy)",
    "memory": "CheckpointManager memory tier (deferred copy)",
    "dcp": "dcp.async_save",
}
OVERHEAD_TARGET = 0.05  # ftsdp + CheckpointManager: at most 5% over not saving
BLOCKING_TARGET = 0.1  # blocking at most 0.1x dcp.async_save's, first and later saves


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop_arguments(p)
    p.add_argument("--dir", default="/dev/shm", help="parent of the checkpoints")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated saving configurations to run, e.g. ftsdp/storage (with their "
        "engines' unsaved rounds); default: all",
    )
    p.add_argument("--out", default=None, help="Markdown file whose Snapshots section to write")
    p.add_argument("--json", default=None, help="JSON results file whose snapshot entry to write")
    return p.parse_args(argv)


def loop_arguments(p: argparse.ArgumentParser) -> None:
    """The training loop's options (this benchmark's and ``bench_busy_rank``'s)."""
    p.add_argument("--world", type=int, default=2, help="CPU ranks (gloo)")
    p.add_argument("--every", type=int, default=2, help="save every N steps")
    p.add_argument("--steps", type=int, default=8, help="steps per round and configuration")
    p.add_argument("--rounds", type=int, default=5, help="rounds (median of their step times)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward")
    p.add_argument("--micro-steps", type=int, default=2, help="forward/backward per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def loop_config(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The ranks' configuration from ``loop_arguments``' options; checkpoints under ``root``."""
    return {
        "model": model_config(args),
        "seed": 0,
        "every": args.every,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "micro_batch": args.micro_batch,
        "micro_steps": args.micro_steps,
        "root": root,
    }


# -- per rank ---------------------------------------------------------------------------------------


class _Run:
    """One engine with one way of checkpointing: its model, optimizer and saver."""

    def __init__(self, engine: str, mode: str, cfg: dict[str, Any], root: str) -> None:
        from ftsdp.checkpoint import CheckpointManager
        from ftsdp.examples.gpt import GPT, GPTConfig, param_groups

        torch.manual_seed(cfg["seed"])
        gpt = GPT(GPTConfig(**cfg["model"]))
        model: torch.nn.Module = gpt
        if engine == "ftsdp":
            import ftsdp
            from ftsdp.examples.gpt import Block

            model = ftsdp.FSDP(gpt, auto_wrap_policy={Block})
        else:
            from torch.distributed.fsdp import fully_shard

            for block in gpt.blocks:
                fully_shard(block)
            fully_shard(gpt)
        self.engine, self.mode, self.cfg = engine, mode, cfg
        self.model = model
        self.opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-3)
        self.url = os.path.join(root, f"{engine}-{mode}")
        self.step = 0
        self.times: list[float] = []  # seconds per step, one per round
        self.blocking: list[float] = []  # per save, in order
        self.fence: list[float] = []  # per save
        self.ckpt: Any = None
        self.dcp_group: dist.ProcessGroup | None = None
        self.dcp_future: Any = None
        for _ in range(cfg["warmup"]):  # optimizer state exists before the first save
            self.train_step()
        if mode == "memory":  # durable saves never due: only the tier, at the round's saves
            self.ckpt = CheckpointManager(
                self.url,
                model,
                self.opt,
                every_steps=None,
                memory_url=f"{self.url}-tier",
                memory_every=1,  # due whenever asked: the rounds decide (any --every)
            )
            self.ckpt.resume({"step": 0})
        elif mode.startswith("storage"):
            self.ckpt = CheckpointManager(
                self.url,
                model,
                self.opt,
                every_steps=cfg["every"],
                keep_last=2,
                defer_copy=mode == "storage",
            )
            self.ckpt.resume({"step": 0})  # a fresh root: prepares the deferred saves
        elif mode == "dcp":
            self.dcp_group = dist.new_group(backend="gloo")

    def train_step(self) -> None:
        cfg = self.cfg
        self.step += 1
        rank = dist.get_rank()
        for micro in range(cfg["micro_steps"]):
            g = torch.Generator().manual_seed(self.step * 1009 + rank * 101 + micro)
            tokens = torch.randint(
                cfg["model"]["vocab_size"],
                (cfg["micro_batch"], cfg["model"]["block_size"] + 1),
                generator=g,
            )
            _, loss = self.model(tokens[:, :-1], tokens[:, 1:])
            (loss / cfg["micro_steps"]).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _pending(self) -> Any:
        """The manager's save in flight to the tier this loop saves to (None: none)."""
        assert self.ckpt is not None
        tier = self.ckpt._memory if self.mode == "memory" else self.ckpt._durable
        return None if tier is None else tier.pending

    def save(self) -> None:
        """Save the current step (nothing without checkpointing)."""
        if self.mode == "none":
            return
        if self.mode == "memory":
            pending = self._pending()
            if pending is not None:
                self.fence.append(pending.fence_wait_seconds)
            self.blocking.append(self.ckpt.save_to_memory(self.step, {"step": self.step}))
            return
        if self.ckpt is not None:
            pending = self._pending()
            if pending is not None:
                self.fence.append(pending.fence_wait_seconds)
            self.blocking.append(self.ckpt.save(self.step, {"step": self.step}))
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        if self.dcp_future is not None:
            self.dcp_future.result()  # one save at a time, as a loop must
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        self.dcp_future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=f"{self.url}/step-{self.step}",
            process_group=self.dcp_group,
        )
        self.blocking.append(time.perf_counter() - t0)

    def finish_saves(self) -> None:
        """Wait until the last save committed; drop DCP's older checkpoints (not timed)."""
        if self.ckpt is not None:
            pending = self._pending()
            self.ckpt.wait()
            if pending is not None:
                self.fence.append(pending.fence_wait_seconds)
        if self.dcp_future is not None:
            self.dcp_future.result()
            self.dcp_future = None

    def prune_dcp(self) -> None:
        if self.mode == "dcp" and dist.get_rank() == 0 and os.path.isdir(self.url):
            for name in sorted(os.listdir(self.url))[:-2]:
                shutil.rmtree(os.path.join(self.url, name), ignore_errors=True)

    def round(self) -> None:
        """``steps`` steps timed barrier to barrier, a save at the start and after every
        ``every`` steps but the last (see the module docstring)."""
        steps, every = self.cfg["steps"], self.cfg["every"]
        dist.barrier()
        t0 = time.perf_counter()
        self.save()  # the state the previous round ended with
        for i in range(1, steps + 1):
            self.train_step()
            if i % every == 0 and i < steps:
                self.save()
        self.finish_saves()
        dist.barrier()
        self.times.append((time.perf_counter() - t0) / self.cfg["steps"])
        self.prune_dcp()


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build every configuration, run the rounds, return the slowest rank's view (rank 0's
    times are barrier to barrier, so they are the slowest rank's). Each round of a saving
    configuration follows a round of the same engine without saving, its pair."""
    runs = [_Run(engine, mode, cfg, cfg["root"]) for engine, mode in configs(cfg.get("only"))]
    unsaved = {run.engine: run for run in runs if run.mode == "none"}
    saving = [run for run in runs if run.mode != "none"]
    pairs: dict[str, list[int]] = {_key(run): [] for run in runs}
    order = random.Random(cfg["seed"])  # the same orders on every rank
    for _ in range(cfg["rounds"]):
        for run in order.sample(saving, len(saving)):
            for one in (unsaved[run.engine], run):
                gc.collect()  # (untimed) no configuration pays for another's garbage
                one.round()
            pairs[_key(run)].append(len(unsaved[run.engine].times) - 1)
    out = {}
    for run in runs:
        if run.ckpt is not None:
            run.ckpt.close()
        out[_key(run)] = {
            "times": run.times,
            "blocking": run.blocking,
            "fence": run.fence,
            "pairs": pairs[_key(run)] or None,  # (an unsaved run: its own rounds)
        }
    return out


def configs(only: list[str] | None) -> list[tuple[str, str]]:
    """The configurations to run: ``only`` (``engine/mode`` keys of saving ones) and the
    unsaved one of each of their engines; all of them without ``only``."""
    if not only:
        return list(CONFIGS)
    unknown = sorted(set(only) - {f"{e}/{m}" for e, m in CONFIGS if m != "none"})
    if unknown:
        raise SystemExit(f"bench_snapshot: --only: no saving configuration {', '.join(unknown)}")
    engines = {key.split("/")[0] for key in only}
    return [(e, m) for e, m in CONFIGS if f"{e}/{m}" in only or (m == "none" and e in engines)]


def _key(run: _Run) -> str:
    return f"{run.engine}/{run.mode}"


# -- the report -------------------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per configuration: median step time, overhead (the median over rounds of the round's
    step time over the same engine's unsaved one in that round, and the quartiles of those
    per-round overheads: how much the machine moved them), first and later blocking
    (the slowest rank per save), fence wait per save (mean over ranks and saves)."""
    out: dict[str, dict[str, float | None]] = {}
    for key in results[0]:
        times = results[0][key]["times"]
        per_save = [
            max(r[key]["blocking"][i] for r in results)
            for i in range(len(results[0][key]["blocking"]))
        ]
        fences = [f for r in results for f in r[key]["fence"]]
        out[key] = {
            "step_s": statistics.median(times),
            "first_blocking_s": per_save[0] if per_save else None,
            "later_blocking_s": statistics.median(per_save[1:]) if len(per_save) > 1 else None,
            "fence_s": statistics.mean(fences) if fences else None,
            "saves": len(per_save),
        }
    for key, row in out.items():  # paired by round: see the module docstring
        mine, base = results[0][key]["times"], results[0][f"{key.split('/')[0]}/none"]["times"]
        pairs = results[0][key].get("pairs") or range(len(mine))
        ratios = [t / base[j] - 1 for t, j in zip(mine, pairs, strict=True)]
        row["overhead_q1"], row["overhead"], row["overhead_q3"] = _quartiles(ratios)
    return out


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """The quartiles of ``xs``, the median in the middle (inclusive method: within its range)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, median, q3


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def table(rows: dict[str, dict[str, Any]], command: str, header: str, every: int) -> str:
    """The Markdown section: the table and the verdicts."""
    lines = [
        "## Snapshots",
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; {header})",
        "",
        "| engine | checkpointing | step ms | overhead | overhead, middle half of the rounds "
        "| blocking ms, first save | blocking ms, later saves | fence wait ms per save | saves |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        engine, mode = key.split("/")
        overhead = "-" if mode == "none" else f"{row['overhead'] * 100:+.1f}%"
        spread = (
            "-"
            if mode == "none"
            else f"{row['overhead_q1'] * 100:+.1f}% to {row['overhead_q3'] * 100:+.1f}%"
        )
        lines.append(
            f"| {engine} | {LABEL[mode]} | {row['step_s'] * 1e3:.1f} | {overhead} | {spread} "
            f"| {_ms(row['first_blocking_s'])} | {_ms(row['later_blocking_s'])} "
            f"| {_ms(row['fence_s'])} | {row['saves']} |"
        )
    lines += ["", *verdicts(rows, every)]
    return "\n".join(lines) + "\n"


def verdicts(rows: dict[str, dict[str, Any]], every: int) -> list[str]:
    """One line per target, MET or MISSED, from the figures of this run."""
    ours, theirs = rows.get("ftsdp/storage"), rows.get("fsdp2/dcp")
    same = rows.get("fsdp2/storage")
    out = []
    if ours is not None:
        ok = ours["overhead"] <= OVERHEAD_TARGET
        out.append(
            f"- saving every {every} steps adds <= {OVERHEAD_TARGET:.0%} to ftsdp's step: "
            f"{'MET' if ok else 'MISSED'} ({ours['overhead'] * 100:+.1f}%)"
        )
    if ours is None or theirs is None or same is None:
        return out  # (--only) the comparisons need all three
    ok = ours["overhead"] < theirs["overhead"]
    out.append(
        f"- ... and less than DCP adds to FSDP2: {'MET' if ok else 'MISSED'} "
        f"({ours['overhead'] * 100:+.1f}% against {theirs['overhead'] * 100:+.1f}%)"
    )
    for which in ("first", "later"):
        mine, dcp = same[f"{which}_blocking_s"], theirs[f"{which}_blocking_s"]
        if mine is None or dcp is None:
            continue
        ratio = mine / dcp
        ok = ratio <= BLOCKING_TARGET
        out.append(
            f"- blocking of the {which} save <= {BLOCKING_TARGET}x dcp.async_save's (same FSDP2 "
            f"state): {'MET' if ok else 'MISSED'} ({ratio:.3f}x: {mine * 1e3:.2f} ms against "
            f"{dcp * 1e3:.2f} ms)"
        )
    return out


def environment(args: argparse.Namespace) -> str:
    """What the figures depend on besides the code."""
    load = os.getloadavg()[0]
    return (
        f"W={args.world} gloo ranks, {args.threads} torch thread each, GPT {args.n_layer} layers "
        f"x {args.n_embd}, {args.micro_steps} x {args.micro_batch} x {args.block_size} tokens per "
        f"step and rank, a save every {args.every} steps to {args.dir}; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, 1-minute load average {load:.1f} at the start"
    )


def reference_loop_ms() -> float:
    """Wall milliseconds of a fixed pure-Python loop (a million additions) on this thread: how
    fast the machine runs now. A shared virtual machine slowed down by its neighbours shows it
    here (several times its usual figure), not in its load average or its steal time."""
    start, x = time.perf_counter(), 0
    for i in range(1_000_000):
        x += i
    return (time.perf_counter() - start) * 1e3


def speed_note(before_ms: float) -> str:
    """The header's note on the machine's speed: ``reference_loop_ms`` before the run (given)
    and now."""
    return (
        f", a reference loop of a million Python additions {before_ms:.0f} ms before the run and "
        f"{reference_loop_ms():.0f} ms after it"
    )


def main(argv: list[str] | None = None) -> None:
    from ftsdp.testing import run_ranks

    args = parse(argv)
    before = reference_loop_ms()
    command = "python -m ftsdp.tools.bench_snapshot " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    header = environment(args)
    only = args.only.split(",") if args.only else None
    configs(only)  # an unknown name fails here, before anything is made
    root = tempfile.mkdtemp(prefix="bench_snapshot-", dir=args.dir)
    cfg = {**loop_config(args, root), "only": only}
    try:
        results = run_ranks(rank_main, args.world, cfg, threads=args.threads, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(results)
    header += speed_note(before)
    text = table(rows, command, header, args.every)
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, "## Snapshots")
    if args.json:
        _bench_json.write_entry(args.json, "snapshot", rows, command, header)


if __name__ == "__main__":
    main()
