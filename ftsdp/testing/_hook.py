"""The fault suite's step hook (the trainer's ``StepHook`` by shape alone): ``FTSDP_FAULT``
faults at step boundaries, crash_in_save faults armed on the checkpoint URL."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ftsdp.testing import _faulty_fs
from ftsdp.testing._faults import Fault, applicable, fire, parse_faults


class FaultHook:
    """The faults that apply to this rank and restart count, fired where the loop calls in."""

    def __init__(
        self, faults: list[Fault], *, rank: int, restart_count: int, incarnation: str = ""
    ) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.faults = applicable(faults, rank, restart_count)

    def checkpoint_url(self, url: str) -> str:
        """``url`` rewritten to the faulty filesystem when a crash_in_save fault applies here."""
        saves = [f for f in self.faults if f.kind == "crash_in_save"]
        if not saves:
            return url
        return _faulty_fs.arm(url, saves, self.rank, self.incarnation)

    def at_step_end(self, step: int) -> None:
        """Fire the ``before_save`` faults of ``step``."""
        self._fire(step, "before_save")

    def after_save(self, step: int) -> None:
        """Fire the ``after_save`` faults of ``step``."""
        self._fire(step, "after_save")

    def needs_commit(self, step: int) -> bool:
        """Whether an ``after_commit`` fault of ``step`` applies (the loop then waits for the
        save in flight to commit and calls :meth:`after_commit`)."""
        return any(f.step == step and f.when == "after_commit" for f in self.faults)

    def after_commit(self, step: int) -> None:
        """Fire the ``after_commit`` faults of ``step``."""
        self._fire(step, "after_commit")

    def _fire(self, step: int, when: str) -> None:
        for f in self.faults:
            if f.step == step and f.when == when and f.kind != "crash_in_save":
                fire(f, self.rank, self.incarnation)


def fault_hook_from_env(
    *, rank: int, restart_count: int, incarnation: str = "", env: Mapping[str, str] | None = None
) -> FaultHook:
    """The hook of ``FTSDP_FAULT`` (in ``env``, default ``os.environ``) for this rank."""
    env = os.environ if env is None else env
    return FaultHook(
        parse_faults(env.get("FTSDP_FAULT", "")),
        rank=rank,
        restart_count=restart_count,
        incarnation=incarnation,
    )
