"""How an object's bytes reach the file: in spans that end on multiples of the write span (so a
local filesystem caches them in large folios, which loads and verify map cheaply), each block's
checksum equal to CRC-32C of its bytes."""

from __future__ import annotations

import io

import crc32c
import torch

from ftsdp.storage.format import _safetensors
from ftsdp.storage.format._safetensors import write_object


class Recorder(io.BytesIO):
    """A file that remembers the (offset, length) of every write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[int, int]] = []

    def write(self, b) -> int:  # type: ignore[override]
        self.writes.append((self.tell(), len(memoryview(b).cast("B"))))
        return super().write(b)


def test_data_is_written_in_spans_aligned_in_the_file_and_checksummed_per_block() -> None:
    span = _safetensors._WRITE_SPAN
    block = 1 << 20
    head = b"h" * 1234  # an odd header length: the first span is shortened to reach alignment
    a = torch.arange(3 * span // 4 + 5, dtype=torch.float32)  # pieces of odd sizes, two chunks
    b = torch.arange(span // 8 + 3, dtype=torch.float64)
    chunks = [(0, a[:1000]), (0, a[1000:]), (1, b)]
    f = Recorder()
    crcs = write_object(f, head, 2, chunks, block)

    data = f.getvalue()
    payload = b"".join(t.numpy().tobytes() for _, t in chunks)
    assert data == head + payload
    writes = f.writes[1:]  # after the header
    assert sum(n for _, n in writes) == len(payload)
    for off, n in writes:
        assert 0 < n <= span
        # no write crosses a multiple of the span, and every full one ends on one
        assert off // span == (off + n - 1) // span, (off, n)
    ends = [off + n for off, n in writes]
    crossing = [e for e in ends[:-1] if e % span == 0]
    assert len(crossing) >= len(payload) // span - 1 and ends[-1] == len(data)
    # one checksum per block of each piece
    for i, t in enumerate((a, b)):
        raw = t.numpy().tobytes()
        assert crcs[i] == [crc32c.crc32c(raw[k : k + block]) for k in range(0, len(raw), block)]


def test_many_small_pieces_in_any_chunking_are_written_and_checksummed_exactly(
    monkeypatch,
) -> None:
    """Pieces of every size around the block and span boundaries (a span of 5000 bytes here),
    each in one or several chunks (tensors or bytes), some empty: the file holds the header and
    the pieces' bytes in order, no write crosses a span boundary, and each piece has CRC-32C of
    each of its blocks (none for an empty piece)."""
    g = torch.Generator().manual_seed(0)
    block, span = 4096, 5000
    monkeypatch.setattr(_safetensors, "_WRITE_SPAN", span)
    for trial in range(40):
        sizes = torch.randint(
            0, 3 * block, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g
        )
        pieces = [torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=g) for n in sizes]
        if trial % 4 == 0:
            pieces[0] = torch.empty(0, dtype=torch.uint8)
        chunks: list = []
        for i, p in enumerate(pieces):
            cuts = sorted(torch.randint(0, len(p) + 1, (trial % 3,), generator=g).tolist())
            for s, e in zip([0, *cuts], [*cuts, len(p)], strict=True):
                part = p[s:e]
                chunks.append((i, memoryview(part.numpy().tobytes()) if (i + s) % 2 else part))
        head = b"x" * (8 + trial)
        f = Recorder()
        crcs = write_object(f, head, len(pieces), chunks, block)
        raws = [p.numpy().tobytes() for p in pieces]
        assert f.getvalue() == head + b"".join(raws)
        for off, n in f.writes[1:]:
            assert off // span == (off + n - 1) // span or n == 0, (off, n)
        for raw, got in zip(raws, crcs, strict=True):
            assert got == [crc32c.crc32c(raw[k : k + block]) for k in range(0, len(raw), block)]
