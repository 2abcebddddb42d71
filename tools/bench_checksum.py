"""Checksum benchmark: what checking a checkpoint costs next to copying its bytes.

    python -m ftsdp.tools.bench_checksum --size-mb 512 --out docs/benchmarks.md

Measured in one run on the same buffer: a memory copy (numpy ``copyto``, the yardstick), the
CRC-32C that format version 3 writes (the ``crc32c`` package), zlib's CRC-32 (versions 1 and 2;
and ISA-L's when the optional ``isal`` package is installed). Then ``storage.catalog.verify`` of a
checkpoint of that size saved by ``storage.save`` in one process: warm (its files in the page
cache, or in ``/dev/shm``) and, on a disk, cold (each file dropped from the page cache first,
``posix_fadvise(DONTNEED)``), and warm again on one CPU (verify checks on as many threads as
the process has CPUs; the copy runs on one). Rates are the best of ``--repeat`` runs; the verdict line compares
the warm verify with the copy (target: at least 0.8x). Prints a table; ``--out FILE`` also writes
it into the "Checksums" section of FILE, ``--json FILE`` its numbers into the ``checksum``
entry of a JSON results file (``ftsdp-report --bench`` charts it). The checkpoint lives in a
temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

import crc32c
import numpy as np
import torch

from ftsdp import storage
from ftsdp.tools import _bench_json
from ftsdp.tools._bench_ranks import drop_cache
from ftsdp.tools._markdown import replace_section

GB = 1e9
TARGET = 0.8  # verify (warm) at least this fraction of a memory copy's rate


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=512, help="bytes checked and copied (MB)")
    p.add_argument("--repeat", type=int, default=5, help="runs per measurement (best is kept)")
    p.add_argument("--dir", default=None, help="parent of the checkpoint (default: a temp dir)")
    p.add_argument("--out", default=None, help="Markdown file whose Checksums section to write")
    p.add_argument("--json", default=None, help="JSON results file whose checksum entry to write")
    return p.parse_args(argv)


def best_rate(nbytes: int, fn: Callable[[], object], repeat: int) -> float:
    """Bytes per second of the fastest of ``repeat`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def kernels(nbytes: int, repeat: int) -> dict[str, float]:
    """Rates of a copy and of each checksum over one buffer of ``nbytes`` random bytes."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    mv = src.data  # a memoryview over the array
    rates = {
        "memory copy (numpy copyto)": best_rate(nbytes, lambda: np.copyto(dst, src), repeat),
        "CRC-32C (crc32c package; version 3)": best_rate(nbytes, lambda: crc32c.crc32c(mv), repeat),
        "CRC-32 (zlib; versions 1-2)": best_rate(nbytes, lambda: zlib.crc32(mv), repeat),
    }
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        pass
    else:
        rates["CRC-32 (ISA-L, optional)"] = best_rate(nbytes, lambda: isal_crc32(mv), repeat)
    return rates


def verify_rates(
    parent: str, nbytes: int, repeat: int
) -> tuple[int, float, float | None, float | None]:
    """Save about ``nbytes`` of tensors under ``parent``; the checkpoint's data bytes and the
    verify rate warm, (not in /dev/shm) cold, and warm on one CPU (where affinity can be set)."""
    dim = 1024
    rows = max(1, nbytes // (4 * dim) // 8)
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(rows, dim, generator=gen) for i in range(8)}
    url = os.path.join(parent, "ckpt")
    storage.save(state, url, step=1)
    step_dir = os.path.join(url, "step-1")
    files = [os.path.join(step_dir, f) for f in os.listdir(step_dir)]
    data = sum(os.path.getsize(f) for f in files if f.endswith(".safetensors"))

    def check() -> None:
        report = storage.catalog.verify(url)
        if not report.ok:
            raise RuntimeError(f"verify found problems in a fresh checkpoint: {report.problems}")

    check()  # warm the page cache and the imports
    warm = best_rate(data, check, repeat)
    one_cpu = None
    if hasattr(os, "sched_setaffinity"):  # verify checks on as many threads as it has CPUs
        cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(cpus)})
        try:
            one_cpu = best_rate(data, check, repeat)
        finally:
            os.sched_setaffinity(0, cpus)
    cold = None
    if not os.path.realpath(parent).startswith("/dev/shm"):

        def cold_check() -> None:
            for f in files:
                drop_cache(f)
            check()

        cold = best_rate(data, cold_check, repeat)
    return data, warm, cold, one_cpu


def table(args: argparse.Namespace, rates: dict[str, float], data: int, warm: float,
          cold: float | None, one_cpu: float | None, where: str) -> str:  # fmt: skip
    copy = rates["memory copy (numpy copyto)"]
    load = os.getloadavg()[0]
    lines = [
        "## Checksums",
        "",
        f"`python -m ftsdp.tools.bench_checksum --size-mb {args.size_mb} --out docs/benchmarks.md`"
        f" ({datetime.date.today().isoformat()}; best of {args.repeat}; torch {torch.__version__},"
        f" {os.cpu_count()} CPUs, 1-minute load average {load:.1f} at the start; checkpoint in"
        f" {where})",
        "",
        "| what | GB/s | / memory copy |",
        "|---|---|---|",
    ]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate / GB:.2f} | {rate / copy:.2f} |")
    lines.append(
        f"| `storage.catalog.verify`, warm ({data / 1e6:.0f} MB of objects) | {warm / GB:.2f} | "
        f"{warm / copy:.2f} |"
    )
    if one_cpu is not None:
        lines.append(
            f"| `storage.catalog.verify`, warm, on one CPU (affinity) | {one_cpu / GB:.2f} | "
            f"{one_cpu / copy:.2f} |"
        )
    if cold is not None:
        lines.append(
            f"| `storage.catalog.verify`, cold (page cache dropped) | {cold / GB:.2f} | {cold / copy:.2f} |"
        )
    lines.append("")
    for what, verify in (("verify (warm)", warm), ("verify (warm, one CPU)", one_cpu)):
        if verify is not None:
            lines.append(
                f"{'MET' if verify / copy >= TARGET else 'MISSED'}: {what} at {verify / copy:.2f}x "
                f"a memory copy's rate (target >= {TARGET}x)."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    nbytes = args.size_mb * 1_000_000
    rates = kernels(nbytes, args.repeat)
    parent = tempfile.mkdtemp(prefix="bench_checksum-", dir=args.dir)
    try:
        data, warm, cold, one_cpu = verify_rates(parent, nbytes, args.repeat)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    where = "/dev/shm" if os.path.realpath(parent).startswith("/dev/shm") else "a local disk"
    text = table(args, rates, data, warm, cold, one_cpu, where)
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, "## Checksums")
    if args.json:
        command = "python -m ftsdp.tools.bench_checksum " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        _bench_json.write_entry(
            args.json,
            "checksum",
            json_entry(rates, warm, cold, one_cpu),
            command,
            environment(where),
        )


def environment(where: str) -> str:
    """What the rates depend on besides the code."""
    load = os.getloadavg()[0]
    return (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1-minute load average {load:.1f}; "
        f"checkpoint in {where}"
    )


def json_entry(
    rates: dict[str, float], warm: float, cold: float | None, one_cpu: float | None
) -> dict:
    """The ``checksum`` entry of the JSON results: every rate in GB/s, and the verdict."""
    copy = rates["memory copy (numpy copyto)"]
    return {
        "rates_gbps": {name: rate / GB for name, rate in rates.items()},
        "verify_warm_gbps": warm / GB,
        "verify_cold_gbps": None if cold is None else cold / GB,
        "verify_warm_one_cpu_gbps": None if one_cpu is None else one_cpu / GB,
        "target_vs_copy": TARGET,
        "met": min(warm, one_cpu or warm) / copy >= TARGET,
    }


if __name__ == "__main__":
    main()
