"""What every format implements (``Source``, ``Sink``) and what streams between them (``Feed``).

A sink writes every file atomically through the store, its commit file last (docs/cli.md, "Errors
and exit codes")."""

from __future__ import annotations

import abc
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftsdp.storage._options import MAX_JSON_DEPTH
from ftsdp.storage.format._grid import Box, Cuts, grid_tiles, strides
from ftsdp.storage.format._json import too_deep
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._streaming import Meter, Request, TensorInfo, group_requests, split_request


class Source(abc.ABC):
    """A checkpoint opened for reading: its tensors and values, known without reading data."""

    format: str = ""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.url = store.url
        self.tensors: dict[str, TensorInfo] = {}
        self.values: dict[str, Any] = {}
        self.step: int | None = None
        self.world_size: int | None = None
        self.rank_values: list[dict[str, Any]] = []
        # entries that cannot be represented -> why (named in reports and by the loaders)
        self.dropped: dict[str, str] = {}

    @abc.abstractmethod
    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """Fill each ``out`` (1-D, contiguous, CPU, the tensor's dtype) with elements
        ``[offset, offset + out.numel())`` of tensor ``name``."""

    def exact_boxes(self, name: str, cuts: Cuts) -> bool:
        """True when ``read_boxes_into`` reads the cells of ``cuts`` of tensor ``name`` with
        little more than their bytes and few copies; else ``Feed`` reads the rows holding each
        (``read_rows_into``)."""
        return False

    def read_boxes_into(self, requests: Sequence[tuple[str, Box, torch.Tensor]]) -> None:
        """Fill each ``out`` (1-D, contiguous, CPU, the tensor's dtype, ``box.numel`` elements)
        with the elements of ``box`` of tensor ``name``, row-major in the box (here: through the
        rows holding it; a source whose ``exact_boxes`` accepts grids reads them itself)."""
        read_rows_into(self, requests)

    def close(self) -> None:  # noqa: B027 - optional: most sources hold nothing to release
        """Release what the reader holds (files, caches)."""

    def dropped_list(self) -> list[str]:
        """``dropped`` as report lines, ``name (why)``."""
        return [f"{name} ({why})" for name, why in self.dropped.items()]

    def keep_value(self, name: str, value: Any) -> None:
        """Keep ``value`` as the JSON value ``name`` (a tuple becomes a list), or name it in
        ``dropped`` with why: not JSON, or nested deeper than a manifest may hold."""
        try:
            out = json.loads(json.dumps(value))
            deep = too_deep({"values": {name: out}}, MAX_JSON_DEPTH)  # as a manifest nests it
        except (TypeError, ValueError):
            self.dropped[name] = f"{type(value).__name__} is not JSON"
            return
        except RecursionError:  # the encoder's own depth guard: deeper still
            deep = True
        if deep:
            self.dropped[name] = f"nests deeper than {MAX_JSON_DEPTH} JSON levels"
        else:
            self.values[name] = out


def read_rows_into(source: Source, requests: Sequence[tuple[str, Box, torch.Tensor]]) -> None:
    """What ``Source.read_boxes_into`` does, through ``source.read_into``: each box is read as the
    row-major range from its first element to its last (at most its rows of dim 0 times the rest
    of the tensor: ``Feed`` makes the requests of such a tensor smaller), then cut."""
    reads, views = [], []
    for name, box, out in requests:
        if not box.numel:
            continue
        st = strides(source.tensors[name].shape)
        lo = sum(o * k for o, k in zip(box.offsets, st, strict=True))
        hi = sum((o + n - 1) * k for o, n, k in zip(*box, st, strict=True)) + 1
        span = torch.empty(hi - lo, dtype=out.dtype)
        reads.append((name, lo, span))
        views.append((span.as_strided(box.lengths, st), out))
    if reads:
        source.read_into(reads)
    for view, out in views:
        out.view(view.shape).copy_(view)


@dataclass(frozen=True)
class OutTensor:
    """An output tensor: its info (name, shape, output dtype) and the source tensor it copies."""

    info: TensorInfo
    source_name: str


class Feed:
    """Serves flat ranges of output tensors from ``source`` in requests of at most ``chunk`` bytes
    (see [Note: the memory budget] in ``storage/io/_streaming.py``): ranges of the row-major
    order, or of the grid order of a tensor given a grid (``set_grid``)."""

    def __init__(self, source: Source, outputs: list[OutTensor], chunk: int, meter: Meter) -> None:
        self.source, self.chunk, self.meter = source, chunk, meter
        self.outputs = {o.info.name: o for o in outputs}
        self._sizes = {
            o.info.name: max(o.info.itemsize, source.tensors[o.source_name].itemsize)
            for o in outputs
        }
        self.grids: dict[str, tuple[Cuts, bool]] = {}  # name -> (cuts, read boxes exactly)

    def set_grid(self, name: str, cuts: Cuts) -> None:
        """Serve output ``name`` in the grid order of ``cuts`` (its ranges are of that order)."""
        exact = self.source.exact_boxes(self.outputs[name].source_name, cuts)
        self.grids[name] = (cuts, exact)
        if not exact:  # a box costs the rows holding it: smaller requests
            shape = self.outputs[name].info.shape
            narrowest = math.prod(min(b - a for a, b in itertools.pairwise(c)) for c in cuts[1:])
            self._sizes[name] *= -(-math.prod(shape[1:]) // max(narrowest, 1))

    @property
    def infos(self) -> list[TensorInfo]:
        return [o.info for o in self.outputs.values()]

    def requests(self, name: str, offset: int, length: int) -> list[Request]:
        """Requests of at most a chunk for elements ``[offset, offset + length)`` of ``name``."""
        return split_request(name, offset, length, self._sizes[name], self.chunk)

    def stream(self, requests: list[Request]) -> Iterator[torch.Tensor]:
        """One 1-D tensor (output dtype) per request, in order; a group of them read at a time."""
        for group in group_requests(requests, self._sizes, self.chunk):
            names = [self.outputs[r.name].source_name for r in group]
            outs = [
                torch.empty(r.length, dtype=self.source.tensors[n].dtype)
                for n, r in zip(names, group, strict=True)
            ]
            reads: list = []
            boxes: dict[bool, list] = {True: [], False: []}  # read exactly, through their rows
            for n, r, o in zip(names, group, outs, strict=True):
                if r.name not in self.grids:
                    reads.append((n, r.offset, o))
                    continue
                cuts, exact = self.grids[r.name]
                shape = self.source.tensors[n].shape
                for box, at in grid_tiles(cuts, shape, r.offset, r.length):
                    boxes[exact].append((n, box, o[at : at + box.numel]))
            if reads:
                self.source.read_into(reads)
            if boxes[True]:
                self.source.read_boxes_into(boxes[True])
            if boxes[False]:
                read_rows_into(self.source, boxes[False])
            for r, o in zip(group, outs, strict=True):
                self.meter.add(o.numel() * o.element_size())
                yield o.to(self.outputs[r.name].info.dtype)
            del reads, boxes, outs

    def block(self, info: TensorInfo, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of output ``info`` as one tensor."""
        out = torch.empty(length, dtype=info.dtype)
        pos = 0
        for t in self.stream(self.requests(info.name, offset, length)):
            out[pos : pos + t.numel()] = t
            pos += t.numel()
        return out


class Sink(abc.ABC):
    """A destination of one format at ``store``'s root."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def holds_checkpoint(self) -> bool:
        """True when the destination already holds a checkpoint of this format."""
        return bool(self.existing())

    def existing(self) -> list[str]:
        """The checkpoint's files there (what ``clear`` removes), the commit file first."""
        return []

    def clear(self) -> None:
        """Remove the checkpoint there (``overwrite``), its commit file first."""
        for name in self.existing():
            self.store.remove(name)

    @abc.abstractmethod
    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int
    ) -> list[str]:
        """Write the tensors of ``feed`` and ``values`` (and per-rank values, and the step, where
        the format has them); the URLs written."""
