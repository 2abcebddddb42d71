"""Two jobs on one root under torchrun's restarts (docs/elastic.md, "CheckpointManager"): a
run that lost its root notes it in the run-wide store, and its restarts refuse the root; a refusal
that names no other job's steps (a lock, the restart's own refusal) notes nothing."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ftsdp.checkpoint import RootInUseError
from ftsdp.trainer._job import refuse_a_root_lost_before, remember_lost_root


class _Ranks:
    """What these functions ask of a RankManager: its store, and the ranks' agreement."""

    def __init__(self, store: object) -> None:
        self._store, self.asked = store, []

    def store(self, prefix: str = "", timeout_s: float | None = None, *, run_wide: bool = False):
        self.asked.append((prefix, run_wide))
        return None if self._store is None else dist.PrefixStore(prefix, self._store)

    def agree_any(self, *flags: bool) -> tuple[bool, ...]:  # one rank: its own flags
        return flags


def test_a_root_lost_to_another_run_is_refused_by_the_restarts(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    rm = _Ranks(dist.HashStore())
    refuse_a_root_lost_before(rm, url)  # nothing noted yet: no refusal
    error = RootInUseError("another job is saving to ROOT: step(s) [30] ...", [30])
    remember_lost_root(rm, url, error)
    assert rm.asked[-1] == ("lost-roots", True)  # seen by every incarnation of the run
    with pytest.raises(RootInUseError, match="an earlier incarnation of this run lost") as e:
        refuse_a_root_lost_before(rm, url)
    assert "another job is saving to ROOT: step(s) [30]" in str(e.value)
    refuse_a_root_lost_before(rm, str(tmp_path / "elsewhere"))  # another root: no refusal


def test_a_lock_refusal_or_a_restarts_refusal_notes_nothing(tmp_path) -> None:
    """Only another job's committed steps are evidence: a lock held a moment too long (a
    forked child of a dead rank) must not refuse every later restart, and a restart's own
    refusal does not note itself again."""
    url = str(tmp_path / "ckpt")
    rm = _Ranks(dist.HashStore())
    remember_lost_root(rm, url, RootInUseError("the slot folder is locked by pid 7"))
    refuse_a_root_lost_before(rm, url)
    remember_lost_root(rm, url, RootInUseError("another job ...", [30]))
    with pytest.raises(RootInUseError) as refused:
        refuse_a_root_lost_before(rm, url)
    remember_lost_root(rm, url, refused.value)  # no steps of its own: the first note stays
    with pytest.raises(RootInUseError) as again:
        refuse_a_root_lost_before(rm, url)
    assert str(again.value) == str(refused.value)
    alone = _Ranks(None)  # one plain process: nothing restarts it
    remember_lost_root(alone, url, RootInUseError("x", [1]))
    refuse_a_root_lost_before(alone, url)


class _BrokenStore:
    def check(self, *args):
        raise RuntimeError("store gone")

    set = get = check


def test_a_store_in_trouble_neither_refuses_nor_raises(tmp_path, caplog) -> None:
    """The check and the note are best effort: a store that fails says so in a warning."""
    url = str(tmp_path / "ckpt")
    rm = _Ranks(None)
    rm.store = lambda *a, **k: _BrokenStore()  # type: ignore[method-assign]
    refuse_a_root_lost_before(rm, url)
    remember_lost_root(rm, url, RootInUseError("x", [1]))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all("store gone" in w for w in warned), warned


def test_every_rank_refuses_when_any_ranks_store_says_so(tmp_path) -> None:
    """The refusal is agreed: a rank whose own look found nothing (its store in trouble) still
    refuses with the others, rather than going on into the build's collectives alone."""
    rm = _Ranks(None)
    rm.agree_any = lambda *flags: (True,)  # type: ignore[method-assign]
    with pytest.raises(RootInUseError, match="lost .* to another job") as e:
        refuse_a_root_lost_before(rm, str(tmp_path / "ckpt"))
    assert "the earlier error" not in str(e.value)
