"""The fault suite's step hook (the trainer's ``StepHook`` by shape alone)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ftsdp.testing import _faulty_fs
from ftsdp.testing._faults import Fault, applicable, fire, is_agent, parse_faults

logger = logging.getLogger(__name__)


class FaultHook:
    """The faults of this rank and restart, fired where the loop calls in (``agent``: its pid)."""

    def __init__(
        self,
        faults: list[Fault],
        *,
        rank: int,
        restart_count: int,
        incarnation: str = "",
        agent: int | None = None,
    ) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.agent = agent
        self.faults = applicable(faults, rank, restart_count)
        self._fired: set[int] = set()  # (indices into faults)

    def checkpoint_url(self, url: str) -> str:
        """``url`` rewritten to the faulty filesystem when a crash_in_save fault applies here."""
        saves = [f for f in self.faults if f.kind == "crash_in_save"]
        return _faulty_fs.arm(url, saves, self.rank, self.incarnation) if saves else url

    def at_step_end(self, step: int) -> None:
        """Fire the ``before_save`` faults of ``step``."""
        self._fire(step, "before_save")

    def after_save(self, step: int) -> None:
        """Fire the ``after_save`` faults of ``step``."""
        self._fire(step, "after_save")

    def needs_commit(self, step: int) -> bool:
        """Whether an ``after_commit`` fault of ``step`` applies (the loop then waits)."""
        return bool(self._due(step, "after_commit"))

    def after_commit(self, step: int) -> None:
        """Fire the ``after_commit`` faults of ``step``."""
        self._fire(step, "after_commit")

    def _due(self, step: int, when: str) -> list[int]:
        """The faults not fired yet at or before ``step``: a fault's step, or the first boundary
        of an incarnation that resumed past it (a resume later than the scenario planned, on a
        loaded machine, must not skip the fault silently)."""
        return [
            i
            for i, f in enumerate(self.faults)
            if i not in self._fired and f.step <= step and f.when == when
            and f.kind != "crash_in_save"
        ]  # fmt: skip

    def _fire(self, step: int, when: str) -> None:
        for i in self._due(step, when):
            self._fired.add(i)
            fire(self.faults[i], self.rank, self.incarnation, self.agent)


def fault_hook_from_env(
    *,
    rank: int,
    restart_count: int,
    incarnation: str = "",
    agent: int | None = None,
    env: Mapping[str, str] | None = None,
) -> FaultHook:
    """The hook of ``FTSDP_FAULT`` (in ``env``, default ``os.environ``) for this rank; a set
    ``FTSDP_FAULT`` is logged (a warning), so that no job fails on purpose unannounced."""
    env = os.environ if env is None else env
    spec = env.get("FTSDP_FAULT", "")
    hook = FaultHook(
        parse_faults(spec),
        rank=rank,
        restart_count=restart_count,
        incarnation=incarnation,
        agent=agent,
    )
    if spec:
        logger.warning(
            f"ftsdp (rank {rank}): fault injection armed by FTSDP_FAULT={spec!r} "
            f"({len(hook.faults)} fault(s) for this rank); unset it outside the fault suite"
        )
        signals_agent = any(f.kind == "kill_node" or f.target == "agent" for f in hook.faults)
        if signals_agent and not is_agent(agent):
            logger.warning(
                "ftsdp (rank %d): FTSDP_FAULT's kill_node and target=agent faults will be refused: "
                "this process was not started by torchrun or ftsdp.launch",
                rank,
            )
    return hook
