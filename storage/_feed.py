"""A ``Feed``: the tensors a writer wants, served from a source in bounded chunks, renamed and cast.

Writers ask for flat ranges of *output* tensors in the order they write them; the feed maps each
output name to its source tensor, cuts the ranges into requests of at most the chunk size, reads
groups of consecutive requests with one ``read_into`` call (so small tensors share a read), casts,
counts the bytes for progress and yields one 1-D tensor per request (see [Note: the memory budget]
in ``storage/_streaming.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ftsdp.storage._sources import Source
from ftsdp.storage._streaming import Meter, Request, TensorInfo, group_requests, split_request


@dataclass(frozen=True)
class OutTensor:
    """An output tensor: its info (name, shape, output dtype) and the source tensor it copies."""

    info: TensorInfo
    source_name: str


class Feed:
    """Serve ranges of output tensors from ``source`` (see the module docstring)."""

    def __init__(self, source: Source, outputs: list[OutTensor], chunk: int, meter: Meter) -> None:
        self.source, self.chunk, self.meter = source, chunk, meter
        self.outputs = {o.info.name: o for o in outputs}
        self._sizes = {
            o.info.name: max(o.info.itemsize, source.tensors[o.source_name].itemsize)
            for o in outputs
        }

    @property
    def infos(self) -> list[TensorInfo]:
        return [o.info for o in self.outputs.values()]

    def requests(self, name: str, offset: int, length: int) -> list[Request]:
        """Requests of at most a chunk for elements ``[offset, offset + length)`` of ``name``."""
        return split_request(name, offset, length, self._sizes[name], self.chunk)

    def stream(self, requests: list[Request]) -> Iterator[torch.Tensor]:
        """One 1-D tensor (output dtype) per request, in order; a group of them read at a time."""
        for group in group_requests(requests, self._sizes, self.chunk):
            outs = []
            for r in group:
                src = self.source.tensors[self.outputs[r.name].source_name]
                outs.append(torch.empty(r.length, dtype=src.dtype))
            self.source.read_into(
                [
                    (self.outputs[r.name].source_name, r.offset, o)
                    for r, o in zip(group, outs, strict=True)
                ]
            )
            for r, o in zip(group, outs, strict=True):
                self.meter.add(o.numel() * o.element_size())
                yield o.to(self.outputs[r.name].info.dtype)
            del outs

    def block(self, info: TensorInfo, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of output ``info`` as one tensor."""
        out = torch.empty(length, dtype=info.dtype)
        pos = 0
        for t in self.stream(self.requests(info.name, offset, length)):
            out[pos : pos + t.numel()] = t
            pos += t.numel()
        return out
