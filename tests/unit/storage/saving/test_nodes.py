"""Node-local roots (storage/saving/_nodes.py) without processes: which step the nodes of a job can
restore, which files go where, and ``save_on_nodes`` in a one-node job. The collectives are tested on real ranks in
tests/distributed/test_checkpoint_manager.py (two simulated nodes, one wiped) and end to end in
tests/e2e/test_faults_node_loss.py."""

from __future__ import annotations

from ftsdp.storage.saving._nodes import Nodes, _choose


def _node(step: int, attempt: str | None, needs: dict[str, int], held: dict[str, int]) -> dict:
    return {str(step): {"attempt": attempt, "needs": needs, "held": held, "size": 100}}


def test_the_ring_sends_each_rank_to_the_same_local_rank_of_the_next_node() -> None:
    nodes = Nodes(("a", "a", "b", "b", "c", "c"))
    assert [nodes.peer(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [nodes.leader(r) for r in range(6)] == [0, 0, 2, 2, 4, 4]
    assert Nodes(("a", "a")).peer(1) is None  # one node: no replica
    assert [Nodes(("a", "b", "b")).peer(r) for r in range(3)] == [1, 0, 0]  # uneven nodes


def test_the_newest_step_the_surviving_nodes_hold_together_is_completed_everywhere() -> None:
    objs = {f"rank0000{r}-000-aa.safetensors": 10 for r in range(4)}
    names = sorted(objs)
    # node 0 (ranks 0, 1) holds its own objects and the replica of the lost node's (2, 3);
    # step 6 reached node 0 without its manifest: not committed, so not chosen
    node0 = {
        **_node(5, "aa", objs, dict(objs)),
        **_node(6, None, {}, {n.replace("aa", "bb"): 10 for n in names}),
    }
    fresh: dict = {}  # the node that replaced the lost one has nothing
    step, moves = _choose([node0, None, fresh, None], [0, 2])
    assert step == 5
    assert moves == [(0, 2, "step-5/manifest.json", 100)] + [
        (0, 2, f"step-5/{n}", 10) for n in names
    ]


def test_no_step_when_the_objects_are_lost_with_two_nodes() -> None:
    objs = {f"rank0000{r}-000-aa.safetensors": 10 for r in range(3)}
    only_own = {n: s for n, s in objs.items() if n.startswith("rank00000")}
    assert _choose([_node(5, "aa", objs, only_own), {}, {}], [0, 1, 2]) is None
    # a size that differs is not held
    wrong = {**objs, "rank00001-000-aa.safetensors": 9}
    assert _choose([_node(5, "aa", objs, wrong)], [0]) is None


def test_objects_spread_over_nodes_are_gathered_and_an_older_step_is_the_fallback() -> None:
    new = {"rank00000-000-bb.safetensors": 10, "rank00001-000-bb.safetensors": 10}
    old = {"rank00000-000-aa.safetensors": 10, "rank00001-000-aa.safetensors": 10}
    a = {**_node(7, "bb", new, {"rank00000-000-bb.safetensors": 10}), **_node(6, "aa", old, old)}
    b = {**_node(7, "bb", new, {"rank00001-000-bb.safetensors": 10}), **_node(6, "aa", old, old)}
    step, moves = _choose([a, b], [0, 1])
    assert step == 7
    assert moves == [
        (1, 0, "step-7/rank00001-000-bb.safetensors", 10),
        (0, 1, "step-7/rank00000-000-bb.safetensors", 10),
    ]
    lost = {"rank00000-000-bb.safetensors": 10}
    a7 = {**_node(7, "bb", new, lost), **_node(6, "aa", old, old)}
    assert _choose([a7], [0]) == (6, [])  # step 7 cannot be completed: step 6


def test_node_lookups_match_their_definition_on_uneven_interleaved_nodes() -> None:
    """Peers and leaders from the precomputed maps equal the definition: the rank of the same
    local index (modulo its size) on the next node, nodes ordered by their lowest rank."""
    import random

    from ftsdp.storage.saving._nodes import Nodes

    rng = random.Random(5)
    of = tuple(rng.choice("abcde") for _ in range(300))
    nodes = Nodes(of)
    order = list(dict.fromkeys(of))
    members = {n: [r for r, x in enumerate(of) if x == n] for n in order}
    for r, n in enumerate(of):
        nxt = members[order[(order.index(n) + 1) % len(order)]]
        assert nodes.peer(r) == nxt[members[n].index(r) % len(nxt)]
        assert nodes.leader(r) == members[n][0]
    assert nodes.order == order and Nodes(("x", "x")).peer(1) is None


def test_save_on_nodes_commits_retains_restores_and_clears_a_node_local_root(tmp_path) -> None:
    """One process as a one-node job: ``save_on_nodes`` commits through the node-local path
    (collectives, leader commit), applies the retention of its SaveOptions, and the step comes
    back through ``restore_on_nodes`` and ``load`` equal to what was saved; ``save`` itself has
    no ``node``."""
    import pytest
    import torch

    from ftsdp import storage
    from ftsdp.storage import saving

    url = str(tmp_path / "shm")
    keep = storage.SaveOptions(keep_last=1)
    states = {s: {"w": torch.randn(33, generator=torch.Generator().manual_seed(s))} for s in (3, 4)}
    for step, state in states.items():
        handle = saving.save_on_nodes(
            {**state, "v": {"step": step}}, url, step, node="n0", options=keep
        )
        handle.wait()
    assert storage.list_steps(url) == [4]  # retention: keep_last=1
    assert saving.restore_on_nodes(url, node="n0") == 4
    target = {"w": torch.zeros(33), "v": {"step": 0}}
    storage.load(target, url)
    assert torch.equal(target["w"], states[4]["w"]) and target["v"] == {"step": 4}
    assert saving.clear_on_nodes(url, node="n0") == [4]
    assert storage.list_steps(url) == []
    with pytest.raises(ValueError, match="node=None"):
        saving.save_on_nodes(states[3], url, 5, node=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="node"):
        storage.save(states[3], url, 5, node="n0")  # type: ignore[call-arg]
