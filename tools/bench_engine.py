"""Engine benchmark: ftsdp FULL_SHARD vs torch FSDP2 (``fully_shard``) vs torch DDP, side by side.

    python -m ftsdp.tools.bench_engine --out docs/benchmarks.md

For each world size (CPU ranks on gloo; plus 1 GPU on NCCL when CUDA is available) one spawned
process group builds the same GPT from the same seed once per engine, feeds every engine the same
batches, warms up, and times forward + backward + AdamW step in rounds (one step of each engine
per round, order rotating, so load from other processes falls on all alike). Reports the median
step time and ftsdp / FSDP2, bytes communicated per step per rank next to ZeRO's formulas, and
model-state memory per rank next to 16·ψ/W + the largest unit. Prints Markdown tables and one
MET / MISSED line per target; ``--out FILE`` also writes them into FILE's "Engine" section,
``--json FILE`` the numbers into the ``engine`` entry of a JSON results file (``ftsdp-report
--bench`` charts them).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pstats
import sys
import time

from ftsdp.testing import run_ranks
from ftsdp.tools import _bench_engine_report as report
from ftsdp.tools import _bench_json

ENGINES = ("ftsdp", "fsdp2", "ddp")
RANK_MAIN = "ftsdp.tools._bench_engine_ranks:rank_main"  # by name: this process never imports torch
VARIANTS = (
    *("no_prefetch", "prefetch", "forward_prefetch", "no_limit", "limit"),
    *("mp", "offload", "hybrid", "grad_op", "no_shard"),
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model (GPT from ftsdp.examples.gpt)")
    m.add_argument("--n-layer", type=int, default=4)
    m.add_argument("--n-embd", type=int, default=256)
    m.add_argument("--n-head", type=int, default=4)
    m.add_argument("--vocab-size", type=int, default=256)
    m.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (<= block size)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per engine (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    p.add_argument("--world-sizes", default="2,4", help="CPU/gloo world sizes, comma-separated")
    p.add_argument("--engines", default="ftsdp,fsdp2,ddp", help="any of " + ",".join(ENGINES))
    p.add_argument(
        "--variants",
        default="",
        help="extra ftsdp runs, comma-separated, of: " + ",".join(VARIANTS) + " (a variant the "
        "installed ftsdp cannot build is listed as skipped, with the reason)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time ftsdp and FSDP2 with the whole model under torch.compile (engines "
        "ftsdp-compiled, fsdp2-compiled; warm-up steps include the compilation)",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        metavar="NAME",
        help="torch.compile's backend for --compile (default inductor, what a user gets; "
        "aot_eager captures forward and backward through Dynamo and AOTAutograd as for inductor "
        "and runs them eagerly: seconds to compile, for a smoke run)",
    )
    p.add_argument("--schedule", choices=("interleaved", "blocked"), default="interleaved")
    p.add_argument(
        "--cuda",
        choices=("auto", "off", "only"),
        default="auto",
        help="the 1 GPU/NCCL run: after the CPU runs when a GPU is there (auto), never, or "
        "alone (only)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--profile", default=None, help="directory for per-rank cProfile dumps")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--out", default=None, help="Markdown file whose Engine section to write")
    p.add_argument("--json", default=None, help="JSON results file whose engine entry to write")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned run")
    args = p.parse_args(argv)
    args.world_sizes = [int(x) for x in args.world_sizes.split(",") if x.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for what, got, allowed in (
        ("--engines", args.engines, ENGINES),
        ("--variants", args.variants, VARIANTS),
    ):
        if set(got) - set(allowed):
            p.error(f"{what}: unknown {sorted(set(got) - set(allowed))}; allowed: {allowed}")
    if not args.engines and not args.variants:
        p.error("nothing to run: give --engines and/or --variants")
    if args.compile_backend != "inductor" and not args.compile:
        p.error(f"--compile-backend {args.compile_backend} without --compile: nothing compiles")
    if args.seq > args.block_size:
        p.error(f"--seq {args.seq} exceeds --block-size {args.block_size}")
    return args


def model_config(args: argparse.Namespace) -> dict[str, int]:
    """The built-in GPT's ``GPTConfig`` fields from the options ``--vocab-size``,
    ``--block-size``, ``--n-layer``, ``--n-head`` and ``--n-embd`` (this benchmark's and the
    snapshot benchmarks')."""
    return {
        "vocab_size": args.vocab_size,
        "block_size": args.block_size,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
    }


def config(args: argparse.Namespace, device: str) -> dict:
    return {
        "model": model_config(args),
        "seed": args.seed,
        "lr": args.lr,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "engines": args.engines,
        "variants": args.variants,
        "compile": args.compile,
        "compile_backend": args.compile_backend,
        "schedule": args.schedule,
        "profile_dir": args.profile,
        "profile_steps": args.profile_steps,
        "device": device,
    }


def run(args: argparse.Namespace) -> list[report.Run]:
    # Quiet the profiler's start/stop lines and its "allocated before profiling" warning.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    plan = [(1, "cuda")] if args.cuda == "only" else [(w, "cpu") for w in args.world_sizes]
    runs: list[report.Run] = []
    while plan:
        world, device = plan.pop(0)
        t0 = time.perf_counter()
        results = run_ranks(
            RANK_MAIN,
            world,
            config(args, device),
            backend="nccl" if device == "cuda" else "gloo",
            timeout=args.timeout,
            threads=args.threads,
        )
        runs.append(report.Run(world, device, results))
        print(
            f"{runs[-1].label}: done in {time.perf_counter() - t0:.0f}s"
            + "".join(f"\n  skipped {k}: {v}" for k, v in results[0]["skipped"].items()),
            flush=True,
        )
        # The ranks say whether CUDA is there: the parent never imports torch.
        if args.cuda == "auto" and device == "cpu" and not plan and results[0]["cuda_available"]:
            plan.append((1, "cuda"))
    return runs


def profile_notes(runs: list[report.Run], top: int = 12) -> str:
    """The top functions by own time on rank 0 for each profiled engine."""
    out = []
    for run in runs:
        for engine, path in run.ranks[0]["profiles"].items():
            stats = pstats.Stats(path)
            table = stats.stats  # type: ignore[attr-defined]  # pstats' raw table: not in typeshed
            rows = sorted(table.items(), key=lambda kv: -kv[1][2])[:top]  # tottime
            total = sum(v[2] for v in table.values())
            out.append(f"{run.label} {engine} rank 0 ({total:.2f}s own time in all):")
            for (file, line, fn), (_, ncalls, tt, ct, _) in rows:
                where = f"{os.path.basename(file)}:{line}" if line else file
                out.append(f"    {tt:7.3f}s own {ct:7.3f}s cum {ncalls:6d} calls  {fn} ({where})")
    return "\n".join(out)


def compile_table(runs: list[report.Run]) -> str:
    """Eager vs compiled median step time of ftsdp and FSDP2, per run."""
    rows = ["| run | engine | eager ms | compiled ms | compiled / eager |", "|---|---|---|---|---|"]
    for run in runs:
        for base in ("ftsdp", "fsdp2"):
            if base in run.engines and f"{base}-compiled" in run.engines:
                eager, compiled = run.median_ms(base), run.median_ms(f"{base}-compiled")
                rows.append(
                    f"| {run.label} | {base} | {eager:.1f} | {compiled:.1f} | "
                    f"{compiled / eager:.2f} |"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command = "python -m ftsdp.tools.bench_engine " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    load_start = os.getloadavg()
    runs = run(args)
    env = report.environment(runs, load_start, os.getloadavg())
    skipped = {k: v for r in runs for k, v in r.ranks[0]["skipped"].items()}
    tables = (
        "Step time (slowest rank per step) and bytes communicated per step per rank:\n\n"
        + report.time_comm_table(runs)
        + "\n\nModel-state memory per rank (the rank holding the most):\n\n"
        + report.memory_table(runs)
    )
    detail = report.comm_detail(runs)
    live = report.live_detail(runs)
    lines = report.verdicts(runs) + report.variant_notes(runs)
    if args.compile:
        tables += (
            f"\n\ntorch.compile of the whole model (backend {args.compile_backend}), step time "
            "(median ms):\n\n"
        )
        tables += compile_table(runs)
    if args.steps < 10:
        lines.append(f"- note: only {args.steps} timed steps (a smoke run, not a measurement)")
    lines += [f"- skipped {k}: {v}" for k, v in skipped.items()]
    print(tables)
    print("\n" + detail)
    print(
        "\nLive at the model-state peak (allocating op < caller < caller), above the step's "
        "start:\n" + live
    )
    print("\n".join(lines))
    print(env)
    if args.profile:
        print(profile_notes(runs))
    if args.out:
        model = (
            f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} "
            f"vocab={args.vocab_size}, ψ = {runs[0].psi:,} parameters; batch {args.batch} x "
            f"{args.seq} tokens per rank; {args.warmup} warm-up + {args.steps} timed steps per "
            f"engine ({args.schedule}); {args.threads} torch thread(s) per rank"
        )
        body = (
            f"## Engine\n\n`{command}` ({datetime.date.today().isoformat()})\n\n{model}. {env}.\n\n"
            f"{tables}\n\nBytes, spelled out:\n\n{detail}\n\nLive at the model-state peak "
            f"(allocating op < caller < caller), above the step's start:\n\n{live}\n\n"
            + "\n".join(lines)
            + "\n\n"
            + NOTES
        )
        report.write_section(args.out, body)
        print(f"wrote the Engine section of {args.out}")
    if args.json:
        _bench_json.write_entry(args.json, "engine", report.json_entry(runs), command, env)
        print(f"wrote the engine entry of {args.json}")


NOTES = """How it is measured:

- Same GPT, seed and batches for every engine; ftsdp wraps each `Block` as a unit
  (`auto_wrap_policy={Block}`), FSDP2 applies `fully_shard` to each `Block` and then the root,
  DDP wraps the whole model; AdamW (`param_groups`, weight decay 0.1) on each. The loss-gap
  column compares each engine's losses with DDP's, step by step (same data, same init).
- Bytes are counted at the collective API with the ring cost per rank ((W−1)·shard for an
  all-gather or reduce-scatter, 2·(W−1)/W·n for an all-reduce): ftsdp's `model.comm_stats`,
  FSDP2 by wrapping `torch.distributed.all_gather_single` / `reduce_scatter_single` /
  `all_reduce` for one step, DDP by a comm hook that all-reduces each bucket. Collectives ftsdp
  issues through `torch.distributed` but does not record in `comm_stats` are listed ("not in
  comm_stats") and left out of the totals. That is the traffic of the collective as NCCL runs
  it. gloo runs some differently: torch's gloo `reduce_scatter_tensor` is an all-reduce of a copy
  of the input, so on the wire both FSDP engines move all-reduce bytes for their gradients here;
  ftsdp, on gloo, runs that same all-reduce on the flat gradient it drops afterwards (no copy)
  and gathers with one in-place broadcast per rank instead of gloo's all-gather, which stages
  the whole output (see the notes in `ftsdp/_collectives.py`). Both engines are counted alike.
- Memory on CPU comes from the profiler's allocator events (`profile_memory=True`): the bytes
  held at the start of a step (parameters and AdamW state, from the tensors themselves) plus the
  running peak of allocations minus frees during it. "Peak model state" runs forward + backward
  on a 1 x 1 token batch, so activations are negligible and what remains is parameters,
  gradients, optimizer state and communication buffers; the optimizer step's own temporaries
  are a separate column, as is the peak of a real step with its activations.
  On GPU, `torch.cuda.max_memory_allocated`. Peak RSS is not used: the allocator reuses freed
  pages, so an RSS high-water mark mostly shows what earlier steps already touched.
- Timing on a shared machine is noisy: compare engines within one run (same rounds), not runs.
"""


if __name__ == "__main__":
    main()
