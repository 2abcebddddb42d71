"""The training loop's step hook: fixed points where something outside the product may act.

The loop calls, on every rank:

- ``checkpoint_url(url)`` once, when the job is built: the URL the checkpoints go to (the hook
  may rewrite it, e.g. to a filesystem that fails on purpose);
- ``at_step_end(step)`` at every step boundary, after step ``step`` completed and before the
  ranks agree on preemption and a time-based save (so before any checkpoint of that step);
- ``after_save(step)`` at every step boundary, after the checkpoint the loop may have started
  and its log line.

The default, :class:`NoStepHook`, does nothing. The fault suite's hook lives in
``ftsdp.testing`` and is plugged in by the training entry only when ``FTSDP_FAULT`` is set; it
satisfies :class:`StepHook` by its shape, so the testing package needs nothing of the trainer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StepHook(Protocol):
    def checkpoint_url(self, url: str) -> str: ...

    def at_step_end(self, step: int) -> None: ...

    def after_save(self, step: int) -> None: ...

    # Optional: ``needs_commit(step) -> bool`` and ``after_commit(step)``. When a hook has them
    # and ``needs_commit(step)`` is true, the loop waits for the save in flight (the one it
    # started at ``step``, else an earlier one still uploading) to commit, then calls
    # ``after_commit(step)`` (the fault suite's ``when=after_commit``).


class HookFactory(Protocol):
    """Makes the hook of one worker once its rank, restart count and incarnation are known."""

    def __call__(self, *, rank: int, restart_count: int, incarnation: str) -> StepHook: ...


class NoStepHook:
    """The default hook: the URL unchanged, nothing at step boundaries."""

    def checkpoint_url(self, url: str) -> str:
        return url

    def at_step_end(self, step: int) -> None:
        pass

    def after_save(self, step: int) -> None:
        pass
