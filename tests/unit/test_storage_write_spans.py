"""How an object's bytes reach the file: in spans that end on multiples of the write span (so a
local filesystem caches them in large folios, which loads and verify map cheaply), each block's
checksum equal to CRC-32C of its bytes."""

from __future__ import annotations

import io

import crc32c
import torch

from ftsdp.storage import _safetensors
from ftsdp.storage._safetensors import write_object


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
