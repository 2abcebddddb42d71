"""ftsdp.testing: test-only machinery; the product never imports it, except the training entry,
which plugs the fault hook in when ``FTSDP_FAULT`` is set (docs/design.md, "Import rules").

- Fault injection (``FTSDP_FAULT``) at the training loop's step boundaries, and the ``faulty://``
  filesystem that dies at chosen points of a checkpoint commit: ``_faults`` (specs, log, firing),
  ``_faulty_fs`` (imports ``_faults``), ``_hook`` (the trainer's step hook, composing both).
- ``run_ranks``: the one rank spawner of the tests and the benchmarks (the parent never imports
  torch).
"""

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
