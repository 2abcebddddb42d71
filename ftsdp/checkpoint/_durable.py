"""The durable tier: the checkpoint root itself (any fsspec URL), with retention."""

from __future__ import annotations

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
