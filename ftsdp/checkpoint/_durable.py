"""The durable tier: the checkpoint root itself (any fsspec URL), with retention."""

from __future__ import annotations

from ftsdp import storage
from ftsdp.checkpoint._tier import Tier


class DurableTier(Tier):
    """Periodic saves under the checkpoint root, ``keep_last`` / ``keep_every`` applied after
    each commit; its errors are raised."""

    def newest_committed(self) -> int | None:
        """The newest step known to be committed by now, without waiting (a failed save's
        error is left for :meth:`wait`)."""
        pending = self.pending
        if pending is not None and pending.done():
            try:
                pending.wait(0)
            except Exception:
                return self.newest
            self.newest = pending.step
        return self.newest

    def close(self) -> None:
        """Rank 0, after a run that saved: a retention pass that removes the objects the last
        retention left for a next save (``SaveOptions.reuse_retired``). Every save applied this
        retention already, so nothing else of the run's own steps goes."""
        if (
            self.options is not None
            and self.options.reuse_retired
            and self.keep_last is not None
            and self.saved  # a resume alone never deletes anything
            and not self.discard_newer
            and self.group.rank_world()[0] == 0
        ):
            try:
                storage.catalog.apply_retention(
                    self.url,
                    keep_last=self.keep_last,
                    keep_every=self.keep_every,
                    storage_options=self.storage_options,
                )
            except OSError as e:
                self.log(f"ftsdp: removing retired objects under {self.url} failed: {e}")
