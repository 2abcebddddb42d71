"""The training loop's step hook: fixed points where something outside the product may act.

The hook satisfies :class:`StepHook` by its shape, so ``ftsdp.testing`` needs nothing of the
trainer (docs/elastic.md, "Fault injection")."""

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
