"""ftsdp.testing: test-only machinery; the product never imports it, except the training entry,
which plugs the fault hook in when ``FTSDP_FAULT`` is set (docs/design.md, "Import rules").

``_faults`` (specs, log, firing), ``_faulty_fs`` (the ``faulty://`` filesystem), ``_hook`` (the
trainer's step hook composing both), ``run_ranks`` (the tests' and benchmarks' rank spawner)."""

from ftsdp.testing._faults import EXIT_INJECTED, Fault, parse_faults
from ftsdp.testing._hook import FaultHook, fault_hook_from_env
from ftsdp.testing._spawn import free_port, run_ranks

__all__ = [
    "EXIT_INJECTED",
    "Fault",
    "FaultHook",
    "fault_hook_from_env",
    "free_port",
    "parse_faults",
    "run_ranks",
]
