"""A tier: one storage root ``CheckpointManager`` saves to and resumes from (docs/elastic.md,
"Tiers"); a ``cache`` tier's errors are logged and its steps passed over, never fatal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from ftsdp import storage
from ftsdp.storage.io import all_reduce_max, broadcast_json, rank_world, resolve_group


class Group:
    """The manager's process group (None: the default) and its agreements (JSON collectives)."""

    def __init__(self, process_group: Any) -> None:
        self.pg = process_group

    def rank_world(self) -> tuple[int, int]:
        """This rank and the world size (0, 1 without torch.distributed)."""
        return rank_world(resolve_group(self.pg))

    def from_rank0(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` (JSON-able, must not raise) on rank 0, its result on every rank."""
        group = resolve_group(self.pg)
        return broadcast_json(compute() if self.rank_world()[0] == 0 else None, group)

    def agree(self, code: int) -> int:
        """The largest ``code`` of every rank."""
        return all_reduce_max([code], resolve_group(self.pg))[0]


class Tier:
    """One storage root: its saves (one in flight at a time), its committed steps, its loads."""

    cache = False  # True: errors are logged, never raised, and its steps never fatal
    name = "the checkpoint root"

    def __init__(
        self,
        url: str,
        group: Group,
        log: Callable[[str], None],
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        options: storage.SaveOptions | None = None,
    ) -> None:
        self.url, self.group, self.log = url, group, log
        self.keep_last, self.keep_every = keep_last, keep_every  # retention after each commit
        self.storage_options, self.options = storage_options, options
        self.pending: storage.SaveHandle | None = None  # kept even when done: errors surface
        self.discard_newer = False  # the next save starts a new timeline here
        self.newest: int | None = None  # the newest step known to be committed here

    def values(self) -> dict[str, Any]:
        """JSON values this tier saves beside the manager's state (and loads back)."""
        return {}

    def foreign(self, step: int, values: dict[str, Any], durable: list[int]) -> str | None:
        """Why ``step`` (with its manifest's ``values``) is not this run's; None: it is (rank 0)."""
        return None

    def save(self, state: dict[str, Any], step: int, node: str | None = None, **kw: Any) -> None:
        """Start saving ``state`` as ``step`` (collective; ``kw`` to ``storage.save``, ``node``:
        ``storage.saving.save_on_nodes``), first surfacing the previous save's error."""
        self.wait()
        options = replace(
            self.options or storage.SaveOptions(),
            keep_last=self.keep_last,  # applied by the committing rank only
            keep_every=self.keep_every,
            discard_newer=self.discard_newer,
        )
        save = storage.save if node is None else partial(storage.saving.save_on_nodes, node=node)
        try:
            self.pending = save(state, self.url, step, options=options, **self._where(), **kw)
        except storage.CheckpointError as e:
            self._failed(e)
        self.discard_newer = False  # once: after this save the newer steps are gone

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error (a cache logs it)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except Exception as e:
            self._failed(e)
        else:
            self.newest = pending.step

    def _where(self) -> dict[str, Any]:
        """The process group and storage options of every storage call on this tier."""
        return {"process_group": self.group.pg, "storage_options": self.storage_options}

    def _failed(self, error: Exception) -> None:
        """A save's error: raised, or logged by a cache."""
        if not self.cache:
            raise error
        self.log(f"ftsdp: a save to {self.name} {self.url} failed: {error}")

    def newest_committed(self) -> int | None:
        """The newest step known to be committed, without waiting (errors left to :meth:`wait`)."""
        pending = self.pending
        if pending is not None and pending.done():
            try:
                pending.wait(0)
            except Exception:
                return self.newest
            self.newest = pending.step
        return self.newest

    def in_flight(self) -> bool:
        """Whether a save is still uploading or committing."""
        return self.pending is not None and not self.pending.done()

    def prepare(self, state: dict[str, Any]) -> None:
        """Storage's group and staging memory for deferred saves of ``state`` (collective)."""
        storage.saving.prepare_save(state, self.url, options=self.options, **self._where())

    def steps(self) -> list[int]:
        """The committed steps, as rank 0 lists them (collective)."""

        def listing() -> tuple[str, Any]:
            try:
                return "ok", storage.list_steps(self.url, storage_options=self.storage_options)
            except FileNotFoundError:
                return "ok", []
            except Exception as e:
                return "error", f"{type(e).__name__}: {e}"

        kind, value = self.group.from_rank0(listing)
        if kind == "ok":
            return list(value)
        if self.cache:
            self.log(f"ftsdp: listing {self.name} {self.url} failed on rank 0: {value}")
            return []
        raise storage.CheckpointError(
            f"listing the checkpoints under {self.url} failed on rank 0: {value}"
        )

    def peek(self, step: int, durable: list[int]) -> tuple[set[str] | None, str | None]:
        """From ``step``'s manifest, read by rank 0 (collective): its ``optim.state.*`` names
        (None: unreadable, the load says why) and :meth:`foreign`'s answer."""

        def peek() -> tuple[list[str] | None, str | None]:
            try:
                m = storage.catalog.read_manifest(
                    self.url, step, storage_options=self.storage_options
                )
            except Exception:
                return None, None
            found = {*m.tensors, *m.values, *(k for values in m.rank_values for k in values)}
            names = sorted(n for n in found if n.startswith("optim.state."))
            return names, self.foreign(step, m.values, durable)

        names, foreign = self.group.from_rank0(peek)
        return (None if names is None else set(names)), foreign

    def load(self, target: dict[str, Any], step: int, options: Any) -> storage.LoadResult:
        """``storage.load`` of ``step`` into ``target`` (collective, all-or-nothing)."""
        return storage.load(target, self.url, step, options=options, **self._where())

    def close(self) -> None:
        """The end of a run, once every save has committed."""
