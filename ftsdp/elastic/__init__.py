"""ftsdp.elastic: the rank manager of elastic torchrun jobs (docs/elastic.md); no engine import."""

from ftsdp.elastic._rank import (
    LaunchEnvironmentError,
    Peer,
    RankInfo,
    RankManager,
    read_env,
    resolve_device,
)
from ftsdp.elastic._sampler import BatchGeometry, GlobalSampler, RankBatchSampler
from ftsdp.elastic._signals import EXIT_GRACE_EXCEEDED, PreemptionHandler
from ftsdp.elastic._simulation import simulate_heartbeats
from ftsdp.elastic._teardown import CloseReport
from ftsdp.elastic._watchdog import EXIT_STALL, Stall, Watchdog

EXIT_PEER_PREEMPTED = 75  # EX_TEMPFAIL: a peer was preempted; restart me (docs/elastic.md)

__all__ = [
    "EXIT_GRACE_EXCEEDED",
    "EXIT_PEER_PREEMPTED",
    "EXIT_STALL",
    "BatchGeometry",
    "CloseReport",
    "GlobalSampler",
    "LaunchEnvironmentError",
    "Peer",
    "PreemptionHandler",
    "RankBatchSampler",
    "RankInfo",
    "RankManager",
    "Stall",
    "Watchdog",
    "read_env",
    "resolve_device",
    "simulate_heartbeats",
]
