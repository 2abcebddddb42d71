"""Snapshot benchmark: what checkpointing every 2 steps costs a training loop, side by side.

    python -m ftsdp.tools.bench_snapshot --out docs/benchmarks.md

A model trains on ``--world`` CPU ranks (gloo) with AdamW, in one spawned run, under each engine
and way of checkpointing. ``--model gpt`` (the default) is the built-in GPT (the main job's
default shape), wrapped per block; ``--model mlp`` is 8 ``nn.Linear(1024, 1024)`` with a ReLU
between (about 50 MB of model and optimizer state per rank at W=2), wrapped per linear, on
``--mlp-batch`` random inputs and targets per forward (MSE loss). The configurations (``CONFIGS``):

- ``ftsdp.FSDP`` without saving, and with ``CheckpointManager`` saving every ``--every`` steps:
  deferred copy (the default: ``save`` returns before copying, ``optimizer.step()`` waits for the
  background copy) and staged copy (``defer_copy=False``: ``save`` copies before it returns);
  and its memory tier alone (no durable save due: ``save_to_memory`` at the same points, keeping
  2 steps, whose saves overwrite the objects of the step they retire);
- ``floor`` on ``ftsdp.FSDP``, the memcpy floor of a snapshot: at each save point the rank's
  state tensors (the flat shards' views and the optimizer's state, the tensors
  ``CheckpointManager`` saves) are copied once, on a background thread, into host buffers
  allocated before the first round, and the next ``optimizer.step()`` waits for that copy (a
  fence, as the deferred copy's). Nothing is written anywhere: no snapshot can cost less;
- torch FSDP2 (``fully_shard``) without saving, with ``dcp.async_save`` every ``--every`` steps
  in its two modes, a thread (``dcp``, the default) and a background process of its own
  (``dcp-process``: ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``, which torch starts
  at the first save and which runs its own gloo group), each on a gloo group of its own, as DCP
  recommends (a save waits for the previous one's future, as a loop must), and with
  ``CheckpointManager`` (deferred copy).

Checkpoints go to ``--dir`` (default ``/dev/shm``: memory, so the figures are the saves' CPU cost,
not a disk's). Every configuration runs ``--steps`` steps per round, ``--rounds`` rounds, the
saving configurations of a round in a random order (seeded; a fixed rotation gave each
configuration the same predecessor, whose leftovers it then always paid for), each right after
a round of the same engine without saving, its pair, and every round after a garbage
collection; a round is timed barrier to barrier (the slowest rank). It saves at its start and
after every ``--every`` steps but the last, so each save has ``--every`` steps of training to
overlap inside the round, as in a long run, and it ends after its last save has committed, so
background work is not left to the next configuration. (A round that saved after its last step
would time that save's whole latency with nothing to overlap: about one save's latency per
round too much, for every way of saving.) The first round of ``dcp-process`` also waits for
torch to start its process: one round of many, which the medians leave out.

Step time is the median over rounds. Overhead is against the same engine without saving,
paired by round: the median over rounds of a round's step time over that of the unsaved round
right before it (the two run back to back, 2 to 3 seconds, so the drift of a shared machine's
speed, often larger than the overhead, mostly cancels; paired with an unsaved round up to six
rounds away, the middle half of the per-round overheads spanned 9 to 17 points).
``overhead / floor`` is a row's overhead over the floor's ("n/a" when the floor's is not above
zero). Blocking is the time ``save`` / ``async_save`` (the floor: starting its copy) kept the
caller, the first save apart (``CheckpointManager.resume`` prepared the deferred saves before
it: storage's own group and the snapshot memory; DCP has no such call). ``fence wait`` is the
time ``optimizer.step()`` waited for a snapshot, per save; ``copy`` the floor thread's time per
copy (the slowest rank's per save, median). ``--only`` (comma-separated ``engine/mode`` keys or
bare modes, ``storage`` being both engines') runs only those saving configurations, with their
engines' unsaved rounds: more rounds of one configuration in the same time. Prints a table;
``--out FILE`` writes it into FILE's "Snapshots" section ("Snapshots, MLP" for the MLP),
``--json FILE`` its numbers into the ``snapshot`` (``snapshot_mlp``) entry of a JSON results
file.
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftsdp.tools import _bench_json
from ftsdp.tools._markdown import replace_section
from ftsdp.tools.bench_engine import model_config

OVERHEAD_TARGET = 0.05  # ftsdp + CheckpointManager: at most 5% over not saving
BLOCKING_TARGET = 0.1  # blocking at most 0.1x dcp.async_save's, first and later saves
FLOOR_TARGET = 2.0  # overhead at most 2x the memcpy floor's
DCP_TARGET = 0.25  # overhead at most 0.25x the better of DCP's two async modes
FLOOR_BLOCKING_SLACK_S = 1e-3  # blocking (later saves) at most the floor's copy plus 1 ms
FLOOR_TARGETED = (
    "ftsdp/storage",
    "ftsdp/persister",
)  # the rows held to the floor's and DCP's targets
MLP_WIDTH, MLP_LAYERS = 1024, 8


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop_arguments(p)
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="the workload")
    p.add_argument("--mlp-batch", type=int, default=16, help="--model mlp: samples per forward")
    p.add_argument("--dir", default="/dev/shm", help="parent of the checkpoints")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated saving configurations to run, engine/mode keys or modes (e.g. "
        "ftsdp/storage, floor,dcp; with their engines' unsaved rounds); default: all",
    )
    p.add_argument(
        "--cuda",
        action="store_true",
        help="train on GPUs (NCCL, one per rank, --world of them): saves copy from the device; "
        "the floor copies into pinned host buffers on a stream of its own",
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


def network(cfg: dict[str, Any]) -> tuple[nn.Module, type[nn.Module]]:
    """The workload's unwrapped model (``cfg["workload"]``: gpt, the default, or mlp) and the
    module class each engine wraps as a unit."""
    if cfg.get("workload", "gpt") == "mlp":
        layers: list[nn.Module] = [nn.Linear(MLP_WIDTH, MLP_WIDTH)]
        for _ in range(MLP_LAYERS - 1):
            layers += [nn.ReLU(), nn.Linear(MLP_WIDTH, MLP_WIDTH)]
        return nn.Sequential(*layers), nn.Linear
    from ftsdp.examples.gpt import GPT, Block, GPTConfig

    return GPT(GPTConfig(**cfg["model"])), Block


def device(cfg: dict[str, Any]) -> torch.device:
    """This rank's device: its GPU with ``cfg["cuda"]``, else the CPU."""
    if cfg.get("cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- how each configuration saves --------------------------------------------------------------


class _Saver:
    """No saves; the base of every way of saving. ``save`` returns the caller's blocking."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.blocking: list[float] = []  # per save, in order
        self.fence: list[float] = []  # per save
        self.copy: list[float] = []  # per save: the floor's copy

    def save(self, step: int) -> float:
        """Start saving ``step``; the seconds that kept the caller."""
        return 0.0

    def finish(self) -> None:
        """Wait until the round's last save committed."""

    def after_round(self) -> None:
        """Untimed housekeeping after a round."""

    def close(self) -> None:
        """Release what the saver holds (threads, processes)."""


class _Manager(_Saver):
    """``CheckpointManager`` saving every ``every`` steps; ``kwargs`` go to its constructor."""

    def __init__(self, run: _Run, **kwargs: Any) -> None:
        from ftsdp.checkpoint import CheckpointManager

        super().__init__(run)
        self.ckpt = CheckpointManager(
            run.url, run.model, run.opt, every_steps=run.cfg["every"], keep_last=2, **kwargs
        )
        self.ckpt.resume({"step": 0})  # a fresh root: prepares the deferred saves

    def _pending(self) -> Any:
        """The manager's save in flight (None: none)."""
        tier = self.ckpt._durable
        return None if tier is None else tier.pending

    def _save(self, step: int) -> float:
        return self.ckpt.save(step, {"step": step})

    def save(self, step: int) -> float:
        pending = self._pending()
        if pending is not None:
            self.fence.append(pending.fence_wait_seconds)
        return self._save(step)

    def finish(self) -> None:
        pending = self._pending()
        self.ckpt.wait()
        if pending is not None:
            self.fence.append(pending.fence_wait_seconds)

    def close(self) -> None:
        self.ckpt.close()


class _Persisted(_Manager):
    """``CheckpointManager(persister=True)``: the copy into shared memory, the rest in the
    persister process; the fence is the optimizer step waiting for that copy."""

    def __init__(self, run: _Run, **kwargs: Any) -> None:
        super().__init__(run, persister=True, **kwargs)
        self.waited = 0.0

    def _fenced(self) -> None:
        snap = self.ckpt._snap
        if snap is not None and snap.on:
            self.fence.append(snap.fence_seconds - self.waited)
            self.waited = snap.fence_seconds

    def save(self, step: int) -> float:
        self._fenced()
        return self._save(step)

    def finish(self) -> None:
        self.ckpt.wait()
        self._fenced()


class _MemoryTier(_Manager):
    """``CheckpointManager``'s memory tier alone: durable saves never due."""

    def __init__(self, run: _Run) -> None:
        from ftsdp.checkpoint import CheckpointManager

        _Saver.__init__(self, run)
        self.ckpt = CheckpointManager(
            run.url,
            run.model,
            run.opt,
            every_steps=None,
            memory_url=f"{run.url}-tier",
            memory_every=1,  # due whenever asked: the rounds decide (any --every)
        )
        self.ckpt.resume({"step": 0})

    def _pending(self) -> Any:
        tier = self.ckpt._memory
        return None if tier is None else tier.pending

    def _save(self, step: int) -> float:
        return self.ckpt.save_to_memory(step, {"step": step})


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's tensors of an ``ftsdp.FSDP`` model's checkpoint: the views of its flat shards
    and the optimizer's state (the ``local`` of each ``ShardView``, else the tensor)."""
    leaves = list(model.sharded_state_dict().values())  # type: ignore[operator]
    for entry in model.sharded_optim_state_dict(opt)["state"].values():  # type: ignore[operator]
        leaves.extend(entry.values())
    local = [getattr(leaf, "local", leaf) for leaf in leaves]
    return [t for t in local if isinstance(t, torch.Tensor)]


class _Floor(_Saver):
    """The memcpy floor: each save copies the state tensors once into buffers of its own, on a
    background thread; the next ``optimizer.step()`` waits for that copy."""

    def __init__(self, run: _Run) -> None:
        super().__init__(run)
        if not run.opt.state:
            raise SystemExit(
                "bench_snapshot: the floor copies the optimizer's state, which exists only after "
                "a step: run it with --warmup 1 or more"
            )
        # taken once: the tensors stay the same objects from step to step (AdamW updates its
        # state in place, and the warm-up steps created it)
        self.sources = state_tensors(run.model, run.opt)
        # zeros, not empty: their pages are touched now, not by the first timed copy; pinned
        # for copies from a GPU (on a stream of their own, after the work queued before save)
        cuda = run.device.type == "cuda"
        self.buffers = [torch.zeros(t.shape, dtype=t.dtype, pin_memory=cuda) for t in self.sources]
        self.stream = torch.cuda.Stream() if cuda else None
        self.ready: Any = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="floor-copy")
        self.pending: Future | None = None
        self.hook = run.opt.register_step_pre_hook(lambda *_: self._wait(fenced=True))

    def _copy(self) -> None:
        start = time.perf_counter()
        if self.stream is None:
            for dst, src in zip(self.buffers, self.sources, strict=True):
                dst.copy_(src)
        else:
            torch.cuda.set_device(self.run.device)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.ready)
                for dst, src in zip(self.buffers, self.sources, strict=True):
                    dst.copy_(src, non_blocking=True)
            self.stream.synchronize()
        self.copy.append(time.perf_counter() - start)

    def _wait(self, fenced: bool) -> None:
        """Wait for the copy in flight; counted as its fence wait if ``optimizer.step()`` waits."""
        if self.pending is None:
            return
        start = time.perf_counter()
        self.pending.result()
        self.fence.append(time.perf_counter() - start if fenced else 0.0)
        self.pending = None

    def save(self, step: int) -> float:
        start = time.perf_counter()
        if self.stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record()  # after the step that made the values
        self.pending = self.pool.submit(self._copy)
        return time.perf_counter() - start

    def finish(self) -> None:
        self._wait(fenced=False)

    def close(self) -> None:
        self.hook.remove()
        self.pool.shutdown()


class _Dcp(_Saver):
    """``dcp.async_save`` on a gloo group of its own, in a thread or (``process``) in DCP's
    background process."""

    def __init__(self, run: _Run, process: bool) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        super().__init__(run)
        self.group = dist.new_group(backend="gloo")
        self.process = process
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.future: Any = None

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        start = time.perf_counter()
        if self.future is not None:
            self.future.result()  # one save at a time, as a loop must
        model_sd, optim_sd = get_state_dict(self.run.model, self.run.opt)
        self.future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=f"{self.run.url}/step-{step}",
            process_group=self.group,
            async_checkpointer_type=self.kind,
        )
        return time.perf_counter() - start

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def after_round(self) -> None:
        """Drop the older checkpoints (rank 0)."""
        url = self.run.url
        if dist.get_rank() == 0 and os.path.isdir(url):
            for name in sorted(os.listdir(url))[:-2]:
                shutil.rmtree(os.path.join(url, name), ignore_errors=True)

    def close(self) -> None:
        if self.process:
            stop_dcp_process()


def stop_dcp_process() -> None:
    """End DCP's background save process, if one runs. torch (2.13) keeps it in a private
    module global until this process exits and has no public call to end it; this sends it
    what its own finalizer sends, and raises if it is still alive a minute later."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
    if proc is None:
        return
    proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
    proc._save_process.join(timeout=60)
    if proc._save_process.is_alive():
        raise RuntimeError(
            f"bench_snapshot: DCP's save process {proc._save_process.pid} did not end within "
            "60 s of being told to; kill it"
        )


# (engine, mode) -> (label, saver, its keyword arguments); each engine's "none" row is the pair
# of its saving rows. A row is one entry here; FLOOR_TARGETED names the rows held to the
# floor's targets.
CONFIGS: dict[tuple[str, str], tuple[str, type[_Saver], dict[str, Any]]] = {
    ("ftsdp", "none"): ("no saves", _Saver, {}),
    ("ftsdp", "floor"): ("memcpy floor (one copy on a thread)", _Floor, {}),
    ("ftsdp", "storage"): ("CheckpointManager (deferred copy)", _Manager, {"defer_copy": True}),
    ("ftsdp", "storage-staged"): (
        "CheckpointManager (staged copy)",
        _Manager,
        {"defer_copy": False},
    ),
    ("ftsdp", "memory"): ("CheckpointManager memory tier (deferred copy)", _MemoryTier, {}),
    ("ftsdp", "persister"): ("CheckpointManager (persister)", _Persisted, {}),
    ("fsdp2", "none"): ("no saves", _Saver, {}),
    ("fsdp2", "dcp"): ("dcp.async_save", _Dcp, {"process": False}),
    ("fsdp2", "dcp-process"): ("dcp.async_save (process)", _Dcp, {"process": True}),
    ("fsdp2", "storage"): ("CheckpointManager (deferred copy)", _Manager, {"defer_copy": True}),
    ("fsdp2", "persister"): ("CheckpointManager (persister)", _Persisted, {}),
}


# -- per rank ---------------------------------------------------------------------------------------


class _Run:
    """One engine with one way of checkpointing: its model, optimizer and saver."""

    def __init__(self, engine: str, mode: str, cfg: dict[str, Any], root: str) -> None:
        torch.manual_seed(cfg["seed"])
        net, unit = network(cfg)
        model: nn.Module = net
        self.device = device(cfg)
        if engine == "ftsdp":
            import ftsdp

            on = self.device if self.device.type == "cuda" else None
            model = ftsdp.FSDP(net, auto_wrap_policy={unit}, device_id=on)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            net.to(self.device)
            # the ranks' own device: FSDP2's default mesh is on CUDA wherever a GPU is
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
            for module in [m for m in net.modules() if isinstance(m, unit)]:
                fully_shard(module, mesh=mesh)
            fully_shard(net, mesh=mesh)
        self.engine, self.mode, self.cfg = engine, mode, cfg
        self.model = model
        if cfg.get("workload", "gpt") == "mlp":
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            from ftsdp.examples.gpt import param_groups

            self.opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-3)
        self.url = os.path.join(root, f"{engine}-{mode}")
        self.step = 0
        self.times: list[float] = []  # seconds per step, one per round
        for _ in range(cfg["warmup"]):  # optimizer state exists before the first save
            self.train_step()
        _, saver, kwargs = CONFIGS[(engine, mode)]
        self.saver = saver(self, **kwargs)

    def train_step(self) -> None:
        cfg = self.cfg
        self.step += 1
        rank = dist.get_rank()
        for micro in range(cfg["micro_steps"]):
            # made on the rank's device: a GPU's batch is not paced by one CPU thread
            g = torch.Generator(self.device).manual_seed(self.step * 1009 + rank * 101 + micro)
            if cfg.get("workload", "gpt") == "mlp":
                shape = (2, cfg["mlp_batch"], MLP_WIDTH)
                x, y = torch.randn(shape, generator=g, device=self.device)
                loss = nn.functional.mse_loss(self.model(x), y)
            else:
                tokens = torch.randint(
                    cfg["model"]["vocab_size"],
                    (cfg["micro_batch"], cfg["model"]["block_size"] + 1),
                    generator=g,
                    device=self.device,
                )
                _, loss = self.model(tokens[:, :-1], tokens[:, 1:])
            (loss / cfg["micro_steps"]).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def save(self) -> None:
        """Save the current step (nothing without checkpointing)."""
        if self.mode != "none":
            self.saver.blocking.append(self.saver.save(self.step))

    def finish_saves(self) -> None:
        """Wait until the last save committed."""
        self.saver.finish()

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
        self.saver.after_round()


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build every configuration, run the rounds, return the slowest rank's view (rank 0's
    times are barrier to barrier, so they are the slowest rank's). Each round of a saving
    configuration follows a round of the same engine without saving, its pair."""
    if cfg.get("cuda"):
        torch.cuda.set_device(rank)
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
        run.saver.close()
        out[_key(run)] = {
            "times": run.times,
            "blocking": run.saver.blocking,
            "fence": run.saver.fence,
            "copy": run.saver.copy,
            "pairs": pairs[_key(run)] or None,  # (an unsaved run: its own rounds)
        }
    return out


def configs(only: list[str] | None) -> list[tuple[str, str]]:
    """The configurations to run: ``only`` (``engine/mode`` keys of saving ones, or modes: every
    engine's) and the unsaved one of each of their engines; all of them without ``only``."""
    if not only:
        return list(CONFIGS)
    saving = [(e, m) for e, m in CONFIGS if m != "none"]
    unknown = sorted(n for n in only if not any(n in (f"{e}/{m}", m) for e, m in saving))
    if unknown:
        raise SystemExit(f"bench_snapshot: --only: no saving configuration {', '.join(unknown)}")
    picked = {(e, m) for e, m in saving if f"{e}/{m}" in only or m in only}
    engines = {e for e, _ in picked}
    return [(e, m) for e, m in CONFIGS if (e, m) in picked or (m == "none" and e in engines)]


def _key(run: _Run) -> str:
    return f"{run.engine}/{run.mode}"


# -- the report -------------------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per configuration: median step time, overhead (the median over rounds of the round's
    step time over the same engine's unsaved one in that round, and the quartiles of those
    per-round overheads: how much the machine moved them), its ratio to the floor's, first
    and later blocking (the slowest rank per save), fence wait per save (mean over ranks and
    saves), the floor's copy (the slowest rank per save, median)."""
    out: dict[str, dict[str, float | None]] = {}
    for key in results[0]:
        times = results[0][key]["times"]
        per_save = [
            max(r[key]["blocking"][i] for r in results)
            for i in range(len(results[0][key]["blocking"]))
        ]
        fences = [f for r in results for f in r[key]["fence"]]
        copies = [
            max(r[key]["copy"][i] for r in results) for i in range(len(results[0][key]["copy"]))
        ]
        out[key] = {
            "step_s": statistics.median(times),
            "first_blocking_s": per_save[0] if per_save else None,
            "later_blocking_s": statistics.median(per_save[1:]) if len(per_save) > 1 else None,
            "fence_s": statistics.mean(fences) if fences else None,
            "copy_s": statistics.median(copies) if copies else None,
            "saves": len(per_save),
        }
    for key, row in out.items():  # paired by round: see the module docstring
        mine, base = results[0][key]["times"], results[0][f"{key.split('/')[0]}/none"]["times"]
        pairs = results[0][key].get("pairs") or range(len(mine))
        ratios = [t / base[j] - 1 for t, j in zip(mine, pairs, strict=True)]
        row["overhead_q1"], row["overhead"], row["overhead_q3"] = _quartiles(ratios)
    floor = out["ftsdp/floor"]["overhead"] if "ftsdp/floor" in out else None
    for key, row in out.items():
        mine, row["overhead_per_floor"] = row["overhead"], None
        if not key.endswith("/none") and mine is not None and floor is not None and floor > 0:
            row["overhead_per_floor"] = mine / floor
    return out


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """The quartiles of ``xs``, the median in the middle (inclusive method: within its range)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, median, q3


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def section(model: str) -> str:
    """The Markdown section a workload's results go to."""
    return "## Snapshots" if model == "gpt" else f"## Snapshots, {model.upper()}"


def table(
    rows: dict[str, dict[str, Any]], command: str, header: str, every: int, model: str = "gpt"
) -> str:
    """The Markdown section: the table and the verdicts."""
    lines = [
        section(model),
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; {header})",
        "",
        "| engine | checkpointing | step ms | overhead | overhead, middle half of the rounds "
        "| overhead / floor | blocking ms, first save | blocking ms, later saves "
        "| fence wait ms per save | copy ms per save | saves |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    floor = rows.get("ftsdp/floor")
    for key, row in rows.items():
        engine, mode = key.split("/")
        overhead = "-" if mode == "none" else f"{row['overhead'] * 100:+.1f}%"
        spread = (
            "-"
            if mode == "none"
            else f"{row['overhead_q1'] * 100:+.1f}% to {row['overhead_q3'] * 100:+.1f}%"
        )
        ratio = row["overhead_per_floor"]
        if ratio is not None:
            per_floor = f"{ratio:.2f}x"
        else:  # not a saving row, no floor in the run, or a floor that cost nothing
            per_floor = "-" if mode == "none" or floor is None else "n/a"
        lines.append(
            f"| {engine} | {CONFIGS[(engine, mode)][0]} | {row['step_s'] * 1e3:.1f} | {overhead} "
            f"| {spread} | {per_floor} | {_ms(row['first_blocking_s'])} "
            f"| {_ms(row['later_blocking_s'])} | {_ms(row['fence_s'])} | {_ms(row['copy_s'])} "
            f"| {row['saves']} |"
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
    if ours is not None and theirs is not None and same is not None:  # (--only) all three
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
                f"- blocking of the {which} save <= {BLOCKING_TARGET}x dcp.async_save's (same "
                f"FSDP2 state): {'MET' if ok else 'MISSED'} ({ratio:.3f}x: {mine * 1e3:.2f} ms "
                f"against {dcp * 1e3:.2f} ms)"
            )
    for key in FLOOR_TARGETED:
        if key in rows:
            out += floor_verdicts(rows, key)
    return out


def floor_verdicts(rows: dict[str, dict[str, Any]], key: str) -> list[str]:
    """The floor's targets for the row ``key``: its overhead against the floor's and the better
    of DCP's two async modes', its later saves' blocking against the floor's copy (each only
    when this run has what it compares with)."""
    engine, mode = key.split("/")
    row, floor, name = rows[key], rows.get("ftsdp/floor"), f"{engine} {CONFIGS[engine, mode][0]}"
    pct = f"{row['overhead'] * 100:+.1f}%"
    out = []
    if floor is not None:
        ratio = row["overhead_per_floor"]
        verdict = "n/a" if ratio is None else "MET" if ratio <= FLOOR_TARGET else "MISSED"
        shown = "" if ratio is None else f"{ratio:.2f}x: "
        out.append(
            f"- {name}: overhead <= {FLOOR_TARGET:g}x the memcpy floor's: {verdict} "
            f"({shown}{pct} against {floor['overhead'] * 100:+.1f}%)"
        )
    dcps = {k: rows[k] for k in ("fsdp2/dcp", "fsdp2/dcp-process") if k in rows}
    if dcps:
        best_key = min(dcps, key=lambda k: dcps[k]["overhead"])
        best = dcps[best_key]["overhead"]
        ok = best > 0 and row["overhead"] <= DCP_TARGET * best
        shown = f"{row['overhead'] / best:.2f}x: " if best > 0 else ""
        out.append(
            f"- {name}: overhead <= {DCP_TARGET:g}x the better of DCP's async modes' "
            f"({' and '.join(dcps)} in this run): {'MET' if ok else 'MISSED'} ({shown}{pct} "
            f"against {best_key}'s {best * 100:+.1f}%)"
        )
    blocking = row["later_blocking_s"]
    copy = None if floor is None else floor["copy_s"]
    if blocking is not None and copy is not None:
        ok = blocking <= copy + FLOOR_BLOCKING_SLACK_S
        out.append(
            f"- {name}: blocking of the later saves <= the floor's copy + "
            f"{FLOOR_BLOCKING_SLACK_S * 1e3:g} ms: {'MET' if ok else 'MISSED'} "
            f"({blocking * 1e3:.2f} ms against {copy * 1e3:.2f} + {FLOOR_BLOCKING_SLACK_S * 1e3:g} ms)"
        )
    return out


def environment(args: argparse.Namespace) -> str:
    """What the figures depend on besides the code (``args``: ``loop_arguments``' options, and
    ``--model`` and ``--mlp-batch`` where the benchmark has them)."""
    load = os.getloadavg()[0]
    workload = getattr(args, "model", "gpt")  # (bench_save_cpu: the GPT alone)
    net, _ = network({"workload": workload, "model": model_config(args)})
    # model, exp_avg and exp_avg_sq in fp32, sharded evenly
    state_mb = sum(p.numel() for p in net.parameters()) * 4 * 3 / args.world / 1e6
    if workload == "mlp":
        shape = (
            f"MLP {MLP_LAYERS} x Linear({MLP_WIDTH}, {MLP_WIDTH}), {args.micro_steps} x "
            f"{args.mlp_batch} samples per step and rank"
        )
    else:
        shape = (
            f"GPT {args.n_layer} layers x {args.n_embd}, {args.micro_steps} x {args.micro_batch} "
            f"x {args.block_size} tokens per step and rank"
        )
    ranks = f"W={args.world} gloo ranks"
    if getattr(args, "cuda", False):
        ranks = f"W={args.world} NCCL ranks on {torch.cuda.get_device_name(0)}"
    return (
        f"{ranks}, {args.threads} torch thread each, {shape}, about "
        f"{state_mb:.0f} MB of model and AdamW state per rank, a save every {args.every} steps "
        f"to {args.dir}; torch {torch.__version__}, {os.cpu_count()} CPUs, 1-minute load "
        f"average {load:.1f} at the start"
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
    cfg = {
        **loop_config(args, root),
        "workload": args.model,
        "mlp_batch": args.mlp_batch,
        "only": only,
        "cuda": args.cuda,
    }
    backend = "nccl" if args.cuda else "gloo"
    try:
        results = run_ranks(
            rank_main, args.world, cfg, backend=backend, threads=args.threads, timeout=1800
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(results)
    header += speed_note(before)
    text = table(rows, command, header, args.every, args.model)
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, section(args.model))
    if args.json:
        entry = "snapshot" if args.model == "gpt" else f"snapshot_{args.model}"
        _bench_json.write_entry(args.json, entry, rows, command, header)


if __name__ == "__main__":
    main()
