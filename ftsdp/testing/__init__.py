"""ftsdp.testing: fault injection, rank spawner; the product imports it only under FTSDP_FAULT."""

from ftsdp.testing._faults import EXIT_INJECTED, Fault, parse_faults
from ftsdp.testing._hook import FaultHook, fault_hook_from_env
from ftsdp.testing._memory import fix_mmap_threshold, reset_peak_rss, status_bytes
from ftsdp.testing._seaweedfs import seaweedfs_server
from ftsdp.testing._spawn import free_port, free_ports, run_ranks

__all__ = [
    "EXIT_INJECTED",
    "Fault",
    "FaultHook",
    "fault_hook_from_env",
    "fix_mmap_threshold",
    "free_port",
    "free_ports",
    "parse_faults",
    "reset_peak_rss",
    "run_ranks",
    "seaweedfs_server",
    "status_bytes",
]
