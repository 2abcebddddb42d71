"""[Note: node-local roots]: one step saved across machines that share no storage, each keeping
its ranks' objects and a replica of the next machine's; committed through collectives on
storage's own gloo group (docs/design.md, "The commit protocol")."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage.format._layout import LATEST, is_own_name, manifest_path, parse_step, step_dir
from ftsdp.storage.format._manifest import Manifest, read_manifest_file
from ftsdp.storage.format._steps import clear_steps
from ftsdp.storage.io._collectives import (
    all_gather_json,
    broadcast_json,
    gather_json,
    own_group,
    rank_world,
    resolve_group,
)
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving._commit import Crcs, Lineage, Reports, commit, plan_lineage, report_of
from ftsdp.storage.saving._save_plan import SavePlan

logger = logging.getLogger(__name__)


class Nodes:
    """Which rank is on which node: ``of[r]`` is rank r's node id (lookups O(1) after one pass)."""

    def __init__(self, of: tuple[str, ...]) -> None:
        self.of = of
        self._members: dict[str, list[int]] = {}  # node -> its ranks
        self._local: list[int] = []  # each rank's index among its node's ranks
        for r, n in enumerate(of):
            self._local.append(len(self._members.setdefault(n, [])))
            self._members[n].append(r)
        self.order = list(self._members)  # the nodes, by their lowest rank
        self._next = {n: self.order[(i + 1) % len(self.order)] for i, n in enumerate(self.order)}

    def ranks(self, node: str) -> list[int]:
        return self._members.get(node, [])

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node (the one that commits and lists there)."""
        return self._members[self.of[rank]][0]

    def peer(self, rank: int) -> int | None:
        """Where ``rank``'s replica goes: the rank of the same local index (modulo its size) on
        the next node; None with one node."""
        if len(self._members) < 2:
            return None
        nxt = self._members[self._next[self.of[rank]]]
        return nxt[self._local[rank] % len(nxt)]


def _error(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


def _transfer(
    store: Store, rank: int, moves: list[tuple[int, int, str, int]], group: dist.ProcessGroup | None
) -> dict[str, bytes]:
    """Run ``moves`` ``(src, dst, rel, size)`` (the same on every rank): ``src`` sends its file
    ``rel`` to ``dst``. Returns what this rank received, unwritten; a source that cannot read
    its file sends zeros and raises afterwards."""
    if group is None:  # a world of one: one node, no replica to move
        return {}
    works: list[dist.Work | None] = []
    received: list[tuple[str, torch.Tensor]] = []
    read_error: BaseException | None = None
    for tag, (src, dst, rel, size) in enumerate(moves):
        if src == rank:
            data = b""
            try:
                data = store.read(rel)
                if len(data) != size:
                    raise CheckpointError(f"{store.where(rel)} has {len(data)} bytes, not {size}")
            except Exception as e:
                read_error, data = read_error or e, bytes(size)
            if size:
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                works.append(dist.isend(buf, dist.get_global_rank(group, dst), group, tag))
        elif dst == rank:
            buf = torch.empty(size, dtype=torch.uint8)
            if size:
                works.append(dist.irecv(buf, dist.get_global_rank(group, src), group, tag))
            received.append((rel, buf))
    for w in works:
        if w is not None:
            w.wait()
    if read_error is not None:
        raise read_error
    return {rel: bytes(buf.numpy()) for rel, buf in received}


def finish_on_nodes(
    store: Store,
    step: int,
    plan: SavePlan,
    rank: int,
    crcs: Crcs,
    error: BaseException | None,
    *,
    node: str,
    group: dist.ProcessGroup | None,
    values: dict[str, Any],
    world_size: int,
    checksum_block_bytes: int,
    keep_last: int | None,
    keep_every: int | None,
    lineage: Lineage | None,
    discard_newer: bool,
) -> None:
    """The commit of a node-local save on ``rank`` (collective over ``group``) once it wrote its
    objects (checksums ``crcs``) or failed (``error``): returns once the step is committed on
    every node, raises on every rank otherwise."""
    own = plan.own(rank)
    # rank 0 builds the manifest from them: what done markers would hold
    full = gather_json(report_of(plan, rank, crcs, values), group)
    report = {"node": node, "error": _error(error), "objects": {o.name: o.size for o in own}}
    reports = all_gather_json(report, group)
    failed = [(r, x["error"]) for r, x in enumerate(reports) if x["error"]]
    if failed:
        if error is not None:
            raise error
        raise CheckpointError(
            f"step {step}: rank {failed[0][0]} failed to write its objects: {failed[0][1]}"
        )
    nodes = Nodes(tuple(x["node"] for x in reports))
    moves = [
        (src, dst, f"{step_dir(step)}/{name}", int(size))
        for src, x in enumerate(reports)
        if (dst := nodes.peer(src)) is not None
        for name, size in sorted(x["objects"].items())
    ]
    replica_error: BaseException | None = None
    try:
        for rel, data in _transfer(store, rank, moves, group).items():
            store.write_bytes(rel, data)
    except Exception as e:
        replica_error = e
    outcome: dict[str, Any] = {"error": _error(replica_error), "manifest": None}
    if rank == 0 and replica_error is None:
        assert full is not None
        try:
            tally = Reports(plan, step, world_size, crcs, values)
            for r, marker in enumerate(full[1:], 1):
                tally.take(r, marker)
            outcome["manifest"] = tally.manifest(checksum_block_bytes).to_json().decode()
        except Exception as e:
            outcome["error"] = _error(e)
    errors = [x for x in all_gather_json(outcome["error"], group) if x]
    if errors:
        raise CheckpointError(f"step {step} on the nodes' roots: {errors[0]}")
    text = broadcast_json(outcome["manifest"], group)
    commit_error: BaseException | None = None
    if nodes.leader(rank) == rank:
        try:
            manifest = Manifest.from_json(text.encode(), where=store.where(manifest_path(step)))
            here = set(nodes.ranks(node))
            holders = {*here, *(r for r in range(len(reports)) if nodes.peer(r) in here)}
            held = {n for r in holders for n in reports[r]["objects"]}
            if rank != 0:  # rank 0's was planned with the save
                lineage = plan_lineage(store, step, discard_newer)
            commit(
                store,
                manifest,
                keep_last=keep_last,
                keep_every=keep_every,
                lineage=lineage,
                present=held,
            )
        except Exception as e:
            commit_error = e
    errors = [x for x in all_gather_json(_error(commit_error), group) if x]
    if commit_error is not None:
        raise commit_error
    if errors:
        raise CheckpointError(f"step {step} was not committed on every node: {errors[0]}")


def _holdings(store: Store) -> dict[str, Any]:
    """Per step: the valid manifest's attempt and objects, and the objects present here."""
    out: dict[str, Any] = {}
    for name, (kind, _) in store.listdir().items():
        step = parse_step(name)
        if step is None or kind != "directory":
            continue
        listing = store.listdir(step_dir(step))
        held = {
            n: size
            for n, (k, size) in listing.items()
            if k == "file" and is_own_name(n) and n.endswith(".safetensors")
        }
        entry: dict[str, Any] = {"held": held, "attempt": None, "needs": {}, "size": 0}
        if "manifest.json" in listing:
            entry["size"] = listing["manifest.json"][1]
            try:
                m = read_manifest_file(store, manifest_path(step))
                if m.step == step:
                    entry["attempt"], entry["needs"] = m.attempt, dict(m.objects)
            except Exception as e:
                logger.warning("node-local root %s, step %d: %s", store.where(), step, e)
        out[str(step)] = entry
    return out


def _choose(
    reports: list[dict[str, Any] | None], leaders: list[int]
) -> tuple[int, list[tuple[int, int, str, int]]] | None:
    """The newest step whose manifest some node holds and whose objects the nodes hold
    together, and the moves ``(src, dst, rel, size)`` that complete every node; or None."""
    found: dict[tuple[int, str], int] = {}  # (step, attempt) -> the first leader with it
    for leader in leaders:
        for s, entry in (reports[leader] or {}).items():
            if entry["attempt"] is not None:
                found.setdefault((int(s), entry["attempt"]), leader)
    for (step, attempt), src in sorted(found.items(), key=lambda kv: (-kv[0][0], kv[1])):
        needs = reports[src][str(step)]["needs"]  # type: ignore[index]
        where: dict[str, int] = {}  # object -> a leader holding it whole
        for leader in leaders:
            held = (reports[leader] or {}).get(str(step), {}).get("held", {})
            for name, size in needs.items():
                if held.get(name) == size:
                    where.setdefault(name, leader)
        if len(where) < len(needs):
            continue
        moves = []
        for dst in leaders:
            entry = (reports[dst] or {}).get(str(step), {})
            if entry.get("attempt") != attempt:
                size = reports[src][str(step)]["size"]  # type: ignore[index]
                moves.append((src, dst, manifest_path(step), size))
            held = entry.get("held", {})
            for name, size in sorted(needs.items()):
                if held.get(name) != size:
                    moves.append((where[name], dst, f"{step_dir(step)}/{name}", size))
        return step, moves
    return None


def restore_on_nodes(
    url: str, *, node: str, process_group: dist.ProcessGroup | None = None
) -> int | None:
    """Make every node's root ``url`` hold a whole committed step and return it (collective over
    every rank of the job): the newest step whose manifest a node holds and whose objects the
    nodes hold together, what a node lacks sent by one that has it; then ``load(state, url,
    step)`` reads it. ``node``: this rank's node id (ranks with one id share the root). None,
    on every rank, when no step qualifies or the exchange failed (logged)."""
    store = Store(url, None)
    group = resolve_group(process_group)
    if group is not None:  # storage's own gloo group for the root's lane, over every rank
        group = own_group(group, store.where())
        if group is None:
            raise ValueError(
                f"node-local saves to {url} need every rank of the job (storage's own gloo "
                "group); the process group given is a subgroup: save over the whole job, or to "
                "a shared root"
            )
    rank, _ = rank_world(group)
    nodes = Nodes(tuple(all_gather_json(node, group)))
    leaders = [nodes.ranks(n)[0] for n in nodes.order]
    mine: dict[str, Any] | None = None
    error: str | None = None
    if nodes.leader(rank) == rank:
        try:
            mine = _holdings(store)
        except Exception as e:
            error = _error(e)
    gathered = all_gather_json({"holdings": mine, "error": error}, group)
    errors = [x["error"] for x in gathered if x["error"]]
    if errors:
        logger.warning("node-local root %s: listing failed: %s", url, errors[0])
        return None
    choice = _choose([x["holdings"] for x in gathered], leaders)
    if choice is None:
        return None
    step, moves = choice
    got: dict[str, bytes] = {}
    failure: str | None = None
    try:
        got = _transfer(store, rank, moves, group)
    except Exception as e:
        failure = _error(e)
    failures = [x for x in all_gather_json(failure, group) if x]
    if not failures:
        try:  # the objects first, the manifest last: a torn copy is never a committed step
            for rel in sorted(got, key=lambda rel: rel.endswith("manifest.json")):
                store.write_bytes(rel, got[rel])
            if got:
                store.write_bytes(LATEST, f"{step}\n".encode())
        except Exception as e:
            failure = _error(e)
        failures = [x for x in all_gather_json(failure, group) if x]
    if failures:
        logger.warning("node-local root %s: restoring step %d failed: %s", url, step, failures[0])
        return None
    if moves:
        what = f"{len(moves)} files, {sum(m[3] for m in moves)} bytes sent"
        logger.info("node-local root %s: step %d restored on every node (%s)", url, step, what)
    return step


def clear_on_nodes(
    url: str, *, node: str, process_group: dist.ProcessGroup | None = None
) -> list[int]:
    """``clear_steps(url)`` once on every node (collective): the lowest rank of each node
    clears its root. Returns the steps it removed (``[]`` on the other ranks)."""
    group = resolve_group(process_group)
    rank, _ = rank_world(group)
    if Nodes(tuple(all_gather_json(node, group))).leader(rank) != rank:
        return []
    return clear_steps(url)
