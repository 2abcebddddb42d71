"""The step hook, satisfied by shape: ``ftsdp.testing`` needs nothing of the trainer."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StepHook(Protocol):
    def checkpoint_url(self, url: str) -> str: ...

    def at_step_end(self, step: int) -> None: ...

    def after_save(self, step: int) -> None: ...

    # Optional: ``needs_commit(step) -> bool``; when true, the loop waits for the save in flight
    # to commit, then calls ``after_commit(step)`` (the fault suite's ``when=after_commit``).


class HookFactory(Protocol):
    """Makes a worker's hook from its rank, restart count, incarnation and ``agent`` pid."""

    def __call__(
        self, *, rank: int, restart_count: int, incarnation: str, agent: int | None
    ) -> StepHook: ...


class NoStepHook:
    """The default hook: the URL unchanged, nothing at step boundaries."""

    def checkpoint_url(self, url: str) -> str:
        return url

    def at_step_end(self, step: int) -> None:
        pass

    def after_save(self, step: int) -> None:
        pass
