"""The watchdog at thousands of ranks, by simulation: ``simulate_heartbeats`` runs W watchdogs'
real per-interval code in one process on a counting in-memory store (no threads, no sockets,
a simulated clock). Detection times are compared with the rule of a watchdog that reads every
peer's key (the first interval at which an observer saw the last change more than the timeout
ago), computed here from the configured intervals (``window``), not taken from the product."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from ftsdp.elastic import simulate_heartbeats

pytestmark = pytest.mark.timeout(60)


def window(timeout_s: float, interval_s: float = 1.0) -> int:
    """Intervals from the last change of a key (seen in the interval it happens) to the first
    check that finds it more than ``timeout_s`` old: the least whole ``w`` with
    ``w * interval_s > timeout_s``, in exact arithmetic (the values are short decimals)."""
    return math.floor(Fraction(str(timeout_s)) / Fraction(str(interval_s))) + 1


def test_the_window_rule_itself() -> None:
    assert [window(3.0), window(2.5, 0.5), window(30.0), window(0.3, 0.05)] == [4, 6, 31, 7]
    assert window(2.9) == 3  # 3 intervals are 3 s > 2.9 s


@pytest.mark.parametrize("world", [8, 64, 1024])
def test_store_traffic_per_interval_is_at_most_4_per_rank(world: int) -> None:
    r = simulate_heartbeats(world, intervals=3, local_world_size=8)
    assert r["healthy_stalls"] == 0
    assert r["keys_per_interval"] <= 4 * world, r  # reading every peer: W + W**2 keys
    assert r["ops_per_interval"] <= 4 * world, r
    assert r["max_keys_per_rank"] <= 4 and r["max_ops_per_rank"] <= 3, r


@pytest.mark.parametrize(
    ("world", "kill", "timeout_s", "interval_s"),
    [
        (64, [0], 3.0, 1.0),  # the first rank
        (64, [63], 3.0, 1.0),  # the last rank
        (64, range(8, 16), 3.0, 1.0),  # a whole node of contiguous ranks
        (64, range(56, 64), 2.5, 0.5),  # the last node
        (16, range(0, 8), 3.0, 1.0),  # one of two nodes
        (1024, [517, 518], 30.0, 1.0),  # the training entry's defaults
    ],
)
def test_stopped_ranks_are_detected_when_reading_every_peer_would_and_all_act(
    world: int, kill, timeout_s: float, interval_s: float
) -> None:
    r = simulate_heartbeats(
        world, kill=kill, heartbeat_timeout_s=timeout_s, interval_s=interval_s, local_world_size=8
    )
    assert r["detect_intervals"] == r["today_detect_intervals"] == window(timeout_s, interval_s), r
    assert r["act_intervals"] <= r["detect_intervals"] + 1, r
    assert r["acted"] == r["survivors"] == world - len(kill)
    assert r["named"] == sorted(kill) and r["kinds"] == ["heartbeat"], r  # each one watched


def test_without_host_layout_a_lost_node_is_still_detected_through_its_first_ranks() -> None:
    r = simulate_heartbeats(64, kill=range(8, 16), heartbeat_timeout_s=3.0, local_world_size=1)
    assert r["detect_intervals"] == r["today_detect_intervals"] == window(3.0), r
    assert r["acted"] == r["survivors"] and r["act_intervals"] <= r["detect_intervals"] + 1
    assert r["named"] == [8, 9]  # watched from the node before; the rest watch each other


@pytest.mark.parametrize(("world", "hang"), [(64, [5]), (64, range(64)), (256, [0, 200])])
def test_a_job_without_progress_names_the_ranks_behind(world: int, hang) -> None:
    r = simulate_heartbeats(world, hang=hang, heartbeat_timeout_s=30.0, progress_timeout_s=4.0)
    assert r["detect_intervals"] == r["today_detect_intervals"] == window(4.0), r
    assert r["act_intervals"] <= r["detect_intervals"] + 1
    assert r["acted"] == r["survivors"] == world
    assert r["named"] == sorted(hang) and r["kinds"] == ["progress"], r


def test_closed_ranks_are_no_stall_and_their_watched_ranks_stay_watched() -> None:
    r = simulate_heartbeats(
        8, closed=[3, 4], heartbeat_timeout_s=3.0, progress_timeout_s=2.0, local_world_size=1
    )
    assert r["acted"] == 0 and r["named"] == [] and r["survivors"] == 6
    # rank 5's two watchers (3 and 4) closed as it stopped: rank 2 takes it over
    r = simulate_heartbeats(8, closed=[3, 4], kill=[5], heartbeat_timeout_s=3.0, local_world_size=1)
    assert r["named"] == [5] and r["acted"] == r["survivors"] == 5
    assert r["detect_intervals"] <= window(3.0) + 1, r  # measured from the takeover


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"ranks \[9\] are not in \[0, 8\)"):
        simulate_heartbeats(8, kill=[9])
    with pytest.raises(ValueError, match="hang= needs progress_timeout_s"):
        simulate_heartbeats(8, hang=[1])
