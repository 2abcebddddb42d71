"""Where an S3 load's time goes: storage against the raw s3fs ceiling, with parts of the load's
contract switched off, on one SeaweedFS server, the variants alternating every round.

    python -m ftsdp.tools.dev.profile_s3_load --load-ranks 2,3 --rounds 12 \\
        --variants raw,storage,storage+nocrc,storage+nocopy,storage+nocrc+nocopy

A W=2 ``bench_checkpoint`` state is saved twice (checksum blocks of 1 MiB and of 256 KiB); then
every round loads it into each ``--load-ranks`` layout once per variant, the order rotating,
each timed barrier to barrier (the slowest rank). A variant is ``raw`` (``cat_ranges`` of
exactly the needed bytes, all at once; ``rawN``: ``N`` requests at a time) or ``storage`` plus
any of:

- ``nocrc``: the blocks read are not checked against their checksums;
- ``nocopy``: nothing is copied into the targets after the reads (they stay as they were);
- ``b256``: the checkpoint saved with 256 KiB checksum blocks;
- ``tN``: ``IOOptions(threads=N)``.

``nocrc`` and ``nocopy`` replace private functions of the reader for the run: they are not
modes of the library, only a measure of what the checks and the copy cost. Printed per load
layout: each variant's median seconds, the median of its per-round ratio raw / variant, and
(``--cpu``) each variant's median CPU seconds per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ftsdp import storage
from ftsdp.storage.format._layout import step_dir
from ftsdp.storage.loading import _reader
from ftsdp.tools import _bench_ranks as ranks

_CHECKSUM, _FINISH = _reader.checksum_function, _reader.Delivery.finish


class _Matches:
    """A "checksum" equal to every expected one: the reader's checks pass without computing."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


_MATCHES = _Matches()


def _unchecked(algorithm: str) -> Any:
    return lambda data, seed: _MATCHES


def _switch(variant: str) -> None:
    flags = set(variant.split("+"))
    _reader.checksum_function = _unchecked if "nocrc" in flags else _CHECKSUM  # type: ignore[assignment]
    _reader.Delivery.finish = (  # type: ignore[method-assign]
        (lambda self, segments, threads: None) if "nocopy" in flags else _FINISH
    )


def save_phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    state = ranks.make_state(cfg["shapes"], init_device_mesh("cpu", (world,)), fill=True)
    for step, block in ((100, 1 << 20), (101, 256 << 10)):
        options = storage.SaveOptions(checksum_block_bytes=block)
        storage.save(state, cfg["url"], step, storage_options=cfg["opts"], options=options)


def load_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    import s3fs
    from torch.distributed.device_mesh import init_device_mesh

    target = ranks.make_state(cfg["shapes"], init_device_mesh("cpu", (world,)), fill=False)
    fs = s3fs.S3FileSystem(**cfg["opts"])
    where = f"{cfg['bucket']}/ckpt/{step_dir(100)}"
    manifest = storage.format.Manifest.from_json(fs.cat(f"{where}/manifest.json"), where=where)
    wanted = ranks._needed_ranges(target, manifest, storage.IOOptions().part_bytes)
    paths = [f"{where}/{o}" for o, _, _ in wanted]
    starts, ends = [a for _, a, _ in wanted], [b for _, _, b in wanted]

    def run(variant: str) -> None:
        flags = variant.split("+")
        if flags[0].startswith("raw"):
            batch = int(flags[0][3:]) if flags[0][3:] else None
            fs.cat_ranges(paths, starts, ends, batch_size=batch)
            return
        threads = next((int(f[1:]) for f in flags if f[:1] == "t" and f[1:].isdigit()), 8)
        options = storage.LoadOptions(io=storage.IOOptions(threads=threads))
        step = 101 if "b256" in flags else 100
        storage.load(target, cfg["url"], step, storage_options=cfg["opts"], options=options)

    variants: list[str] = cfg["variants"]
    out: dict[str, list[float]] = {}
    try:
        for rnd in range(cfg["rounds"] + 1):  # round 0 warms every variant up
            k = rnd % len(variants)
            for v in variants[k:] + variants[:k]:
                _switch(v)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                run(v)
                cpu = time.process_time() - c0
                wall = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                if rnd:
                    out.setdefault(v, []).append(float(wall))
                    out.setdefault(f"{v} cpu", []).append(cpu)
    finally:
        _switch("")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load-ranks", default="2,3", help="world sizes to load into")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (after one warm-up)")
    p.add_argument("--variants", default="raw,storage,storage+nocrc+nocopy")
    p.add_argument("--size-mb", type=int, default=250, help="state bytes across all ranks (MB)")
    p.add_argument("--cpu", action="store_true", help="also print CPU seconds per rank")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "raw" not in variants:
        p.error("--variants must include raw (the ratios are against it)")

    import s3fs

    from ftsdp.testing import run_ranks, seaweedfs_server

    with seaweedfs_server() as opts:
        s3fs.S3FileSystem(**opts).mkdir("bench")
        cfg = {
            "shapes": ranks.shapes(args.size_mb * 10**6, 1024),
            "url": "s3://bench/ckpt",
            "bucket": "bench",
            "opts": opts,
            "rounds": args.rounds,
            "variants": variants,
        }
        run_ranks(save_phase, 2, cfg, timeout=900)
        for w in (int(x) for x in args.load_ranks.split(",") if x.strip()):
            results = run_ranks(load_phase, w, cfg, timeout=1800)
            res, raw = results[0], results[0]["raw"]
            print(f"load 2 -> {w}:")
            for v in variants:
                ratio = statistics.median(r / s for r, s in zip(raw, res[v], strict=True))
                line = f"  {v:<28} {statistics.median(res[v]):.3f} s  raw / it {ratio:.2f}x"
                if args.cpu:
                    cpus = [statistics.median(r[f"{v} cpu"]) for r in results]
                    line += "  CPU s per rank " + ", ".join(f"{c:.3f}" for c in cpus)
                print(line)


if __name__ == "__main__":
    main()
