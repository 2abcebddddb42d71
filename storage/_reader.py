"""Execute a read plan: concurrent ranged reads, checksum verification, copies into staging."""

from __future__ import annotations

import zlib
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from storage._errors import CorruptCheckpointError
from storage._fs import Store
from storage._layout import step_dir
from storage._ranges import split
from storage._read_plan import Span


def _verify_and_copy(store: Store, step: int, block: int, span: Span, buf: bytearray) -> None:
    mv = memoryview(buf)
    for name, piece, k in span.blocks.values():
        start = piece.byte_start + k * block
        end = min(start + block, piece.byte_end)
        if zlib.crc32(mv[start - span.start : end - span.start]) != piece.crc32[k]:
            raise CorruptCheckpointError(
                f"checksum mismatch in tensor {name!r} (step {step}, object "
                f"{store.where(f'{step_dir(step)}/{piece.object}')}, bytes [{start}, {end})); "
                "the checkpoint is corrupt, load another step"
            )
    for c in span.copies:
        src = torch.frombuffer(buf, dtype=torch.uint8, count=c.nbytes, offset=c.src - span.start)
        c.dst[c.dst_byte : c.dst_byte + c.nbytes].copy_(src)


def execute(store: Store, step: int, block: int, spans: list[Span]) -> int:
    """Read every span (parts of ``store.io.part_bytes`` in flight concurrently); bytes read."""
    if not spans:
        return 0
    bufs = [bytearray(s.end - s.start) for s in spans]
    left = [0] * len(spans)
    jobs = []
    for i, s in enumerate(spans):
        for a, b in split(s.start, s.end, store.io.part_bytes):
            jobs.append((i, a, b))
            left[i] += 1

    def fetch(i: int, a: int, b: int) -> int:
        s = spans[i]
        data = store.read_range(f"{step_dir(step)}/{s.object}", a, b)
        bufs[i][a - s.start : b - s.start] = data
        return i

    with ThreadPoolExecutor(store.io.threads, "storage-read") as pool:
        pending = {pool.submit(fetch, *job) for job in jobs}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in done:
                    i = fut.result()
                    left[i] -= 1
                    if left[i] == 0:
                        _verify_and_copy(store, step, block, spans[i], bufs[i])
                        bufs[i] = bytearray()  # free it
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return sum(s.end - s.start for s in spans)
