"""Stress the end of a job: do real torchrun workers exit 0 after closing the rank manager?

    python -m ftsdp.tools.dev.stress_close --runs 30 --nproc 3                  # the ftsdp engine
    python -m ftsdp.tools.dev.stress_close --runs 30 --nproc 3 --variant fsdp2  # torch's fully_shard
    python -m ftsdp.tools.dev.stress_close --runs 10 --nproc 2 --variant train  # the main job

Each run is one ``torchrun --standalone --nproc-per-node=N`` of a small worker, a fresh set of
processes that exits through the interpreter's normal shutdown (as a user's script does):

- ``ftsdp``: ``RankManager.init()``, the built-in GPT wrapped by
  ``ftsdp.FSDP(..., auto_wrap_policy={Block})``, one AdamW step, the full ``state_dict()``,
  ``rm.close()``, and the model still referenced when the interpreter exits;
- ``wrap``: only ``RankManager.init()``, the wrap and ``rm.close()`` (the issue's reproduction);
- ``fsdp2``: the same with torch's ``fully_shard`` on every block and the root, and the full
  state dict from ``torch.distributed.checkpoint.state_dict.get_model_state_dict``;
- ``plain``: a script as docs/migrating.md has it, without the rank manager:
  ``dist.init_process_group("gloo")``, the wrap, the step and the state dict of ``ftsdp``,
  then ``dist.destroy_process_group()``; the exit is left to what ``import ftsdp`` registers
  (docs/elastic.md, "Teardown");
- ``train``: ``python -m ftsdp.train`` (a tiny GPT, 2 steps, an async checkpoint every step):
  the training entry's end of run.

``--provoke`` makes the race that aborts far more likely than a plain run does, the way the
suite's ``tests/e2e/test_teardown.py`` runs it: after the state dict, every rank creates a
subgroup that it keeps referenced until the interpreter exits (as a 2-D mesh or HYBRID_SHARD
keeps theirs), leaves an ``all_reduce`` of a temporary view in flight on it (only its ``Work``
holds the view, so the gloo worker thread that finishes it drops the last reference to a Python
tensor), and keeps the GIL until it blocks (``sys.setswitchinterval(1000)``); rank 0 issues it a
second late. On rank 0 the collective then finishes at once, while the main thread keeps the GIL
through ``close()``: unless ``close()`` lets the worker drop the finished work before the
interpreter finalizes, the worker asks for the GIL during finalization and the rank aborts. On
the code before the teardown fix 7 of 12 such runs at W=3 aborted (always rank 0), none of 18
after it.

A worker that aborts at exit ("terminate called without an active exception") dies with SIGABRT:
torchrun reports its exit code as -6 (134 through a shell) and kills the other ranks. The tool
reads every failed rank's exit code from torchrun's report and prints one line per run, then
``aborts A/R runs`` (and other failures and timeouts, if any). It exits 0 when every run exited 0,
1 otherwise. ``--json PATH`` writes the per-run results for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

VARIANTS = ("ftsdp", "wrap", "fsdp2", "plain", "train")
_ABORT_CODES = (-signal.SIGABRT, 128 + signal.SIGABRT)
# torchrun's failure report: one block per failed rank ("rank : 1 (local_rank: 1)" then
# "exitcode : -6 (pid: ...)").
_REPORT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class Run:
    """One torchrun job: its exit status and every failed rank's exit code."""

    index: int
    returncode: int | None  # None: killed after the timeout
    seconds: float
    ranks: dict[int, int] = field(default_factory=dict)  # failed rank -> its exit code
    terminate: bool = False  # "terminate called ..." in the output

    @property
    def outcome(self) -> str:
        if self.returncode is None:
            return "timeout"
        if self.terminate or any(code in _ABORT_CODES for code in self.ranks.values()):
            return "abort"
        return "ok" if self.returncode == 0 else "failed"

    def describe(self) -> str:
        codes = ", ".join(f"rank {r}: {_signal_name(c)}" for r, c in sorted(self.ranks.items()))
        return f"{self.outcome} (exit {self.returncode}{'; ' + codes if codes else ''})"


def _signal_name(code: int) -> str:
    """``-6 (SIGABRT)``, ``134 (SIGABRT)`` (a shell's 128 + N), or the plain exit code."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return f"{code} ({signal.Signals(number).name})"
    except ValueError:
        return str(code)


# ---------------------------------------------------------------------------------- the workers
def _tiny_gpt():  # imported lazily: the parent never imports torch
    import torch

    from ftsdp.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(config), config


def _batch(rank: int, config):
    import torch

    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (2, config.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def worker(variant: str, provoke: bool = False) -> None:
    """One rank of a run (started by torchrun); returns normally, so the interpreter exits
    through its usual shutdown with the model still referenced (``_KEEP``)."""
    import torch
    import torch.distributed as dist

    from ftsdp.elastic import RankManager
    from ftsdp.examples.gpt import Block

    if variant == "plain":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rm = RankManager.init(device="cpu", timeout_s=60)
        rank, world = rm.rank, rm.world_size
    model, config = _tiny_gpt()
    if variant in ("ftsdp", "wrap", "plain"):
        import ftsdp

        model = ftsdp.FSDP(model, auto_wrap_policy={Block})
        if variant == "wrap":  # the shortest sequence reported to abort: wrap, then close
            rm.close()
            _KEEP.append(model)
            return
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(rank, config)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if variant in ("ftsdp", "plain"):
        full = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert len(full) > 0
    if provoke:  # see the module doc
        side = dist.new_group(list(range(world)))
        _KEEP.append(side)  # held past close(), freed at exit: its destructor joins its threads
        sys.setswitchinterval(1000.0)
        if rank == 0:
            time.sleep(1.0)  # late: its collective finishes at once, with the GIL held here
        scratch = torch.ones(1 << 16)
        dist.all_reduce(scratch.view(-1), group=side, async_op=True)
    if variant == "plain":
        dist.destroy_process_group()
    else:
        rm.close()
    _KEEP.extend([model, opt, full])  # alive until the interpreter shuts down, as in a script


_KEEP: list = []


def _train_command(nproc: int, workdir: str) -> list[str]:
    batch = 12  # divisible by 1, 2, 3, 4, 6
    return [
        *["-m", "ftsdp.train", "--device", "cpu", "--steps", "2", "--log-every", "1"],
        *["--vocab-size", "64", "--block-size", "16", "--n-layer", "2", "--n-head", "2"],
        *["--n-embd", "32", "--global-batch", str(batch), "--micro-batch", str(batch // nproc)],
        *["--checkpoint-url", os.path.join(workdir, "ckpt"), "--checkpoint-every", "1"],
    ]


# ---------------------------------------------------------------------------------- the driver
def run_once(
    variant: str, nproc: int, index: int = 0, timeout: float = 180.0, provoke: bool = False
) -> Run:
    """One torchrun job of ``variant`` at ``nproc`` workers; its :class:`Run`."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="stress_close-") as workdir:
        if variant == "train":
            target = _train_command(nproc, workdir)
        else:
            target = ["-m", "ftsdp.tools.dev.stress_close", "--worker", variant]
            target += ["--provoke"] if provoke else []
        cmd = [
            sys.executable,
            *["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"],
            *target,
        ]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"") + (e.stderr or b"")
            text = out.decode(errors="replace") if isinstance(out, bytes) else out
            run = Run(index, None, time.monotonic() - t0)
            run.terminate = "terminate called" in text
            return run
        text = proc.stdout + proc.stderr
        run = Run(index, proc.returncode, time.monotonic() - t0)
        run.ranks = {int(r): int(c) for r, c in _REPORT.findall(text)}
        run.terminate = "terminate called" in text
        if run.outcome != "ok" and os.environ.get("FTSDP_STRESS_VERBOSE"):
            print(text[-6000:], file=sys.stderr)
        return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftsdp.tools.dev.stress_close",
        description="Run torchrun jobs that end by closing the rank manager; count the ones "
        "whose workers do not exit 0 (aborts: SIGABRT at exit).",
    )
    parser.add_argument("--runs", type=int, default=30, help="torchrun jobs (default 30)")
    parser.add_argument("--nproc", type=int, default=3, help="workers per job (default 3)")
    parser.add_argument("--variant", choices=VARIANTS, default="ftsdp", help="see the module doc")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per job")
    parser.add_argument(
        "--provoke", action="store_true", help="make the exit race certain (see the module doc)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the per-run results here")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, provoke=args.provoke)
        return 0
    if args.runs < 1 or args.nproc < 1:
        parser.error("--runs and --nproc must be >= 1")
    if args.provoke and args.variant in ("train", "wrap"):
        parser.error("--provoke works with --variant ftsdp, fsdp2 or plain")
    runs: list[Run] = []
    t0 = time.monotonic()
    for i in range(args.runs):
        run = run_once(args.variant, args.nproc, i, args.timeout, provoke=args.provoke)
        runs.append(run)
        print(f"run {i + 1}/{args.runs}: {run.describe()} in {run.seconds:.1f}s", flush=True)
    counts = Counter(r.outcome for r in runs)
    others = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("ok", "abort"))
    print(
        f"{args.variant}{' --provoke' if args.provoke else ''} W={args.nproc}: "
        f"aborts {counts['abort']}/{args.runs} runs"
        + (f" ({others})" if others else "")
        + f"; {time.monotonic() - t0:.0f}s"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "variant": args.variant,
                    "nproc": args.nproc,
                    "provoke": args.provoke,
                    "runs": [{**asdict(r), "outcome": r.outcome} for r in runs],
                },
                f,
                indent=1,
            )
    return 0 if counts["ok"] == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
