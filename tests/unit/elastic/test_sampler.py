"""The global sampler and batch geometry: one sample order for every world size and restart."""

from __future__ import annotations

import itertools

import pytest

from ftsdp.elastic import BatchGeometry, GlobalSampler, RankBatchSampler

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 1000, 4097])
def test_each_epoch_is_a_permutation(n: int) -> None:
    s = GlobalSampler(n, seed=5)
    for epoch in range(3):
        ids = s.indices(epoch * n, n)
        assert sorted(ids) == list(range(n)), (n, epoch)


def test_epochs_and_seeds_differ_and_instances_agree() -> None:
    a, b = GlobalSampler(1000, seed=1), GlobalSampler(1000, seed=1)
    assert a.indices(0, 2000) == b.indices(0, 2000)
    assert a.indices(0, 1000) != a.indices(1000, 1000)  # a new order each epoch
    assert a.indices(0, 1000) != GlobalSampler(1000, seed=2).indices(0, 1000)
    assert a.indices(0, 1000) != list(range(1000))
    assert GlobalSampler(10, shuffle=False).indices(5, 10) == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


def test_huge_datasets_need_no_materialised_permutation() -> None:
    s = GlobalSampler(1 << 40, seed=0)
    ids = s.indices(123_456_789, 256)
    assert len(set(ids)) == 256 and all(0 <= i < 1 << 40 for i in ids)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 12, 13])
def test_a_step_has_the_same_samples_at_every_world_size(world: int) -> None:
    s = GlobalSampler(50, seed=3)  # small: steps cross epoch boundaries
    g = BatchGeometry(global_batch=12, micro_batch=1, world_size=world)
    for cursor in (0, 12, 36, 48, 96):
        per_rank = [s.micro_batch(cursor, g, r, m) for r in range(world) for m in range(g.share(r))]
        assert list(itertools.chain(*per_rank)) == s.step_indices(cursor, 12)


def test_restarting_from_a_cursor_skips_and_repeats_nothing() -> None:
    n, gb = 60, 12
    s = GlobalSampler(n, seed=9)
    stream: list[int] = []
    cursor = 0
    # Restart after every two steps at another world size: the stream is the same.
    for world in (6, 2, 5, 3, 1, 4):
        g = BatchGeometry(global_batch=gb, micro_batch=2, world_size=world)
        for r in range(world):
            assert len(RankBatchSampler(s, g, r, cursor=cursor, steps=2)) == 2 * g.share(r)
        for _ in range(2):
            for r in range(world):
                for m in range(g.share(r)):
                    stream += s.micro_batch(cursor, g, r, m)
            cursor += gb
    assert stream == s.indices(0, len(stream))
    assert sorted(stream[:n]) == list(range(n))  # epoch 0: each sample exactly once
    assert list(
        RankBatchSampler(
            s, BatchGeometry(global_batch=gb, micro_batch=2, world_size=2), 1, cursor=12, steps=1
        )
    ) == [
        s.indices(18, 2),
        s.indices(20, 2),
        s.indices(22, 2),
    ]


def test_geometry_derives_accumulation_and_rank_blocks() -> None:
    g = BatchGeometry(global_batch=24, micro_batch=2, world_size=3)
    assert (g.micro_batches, g.accum_steps, [g.share(r) for r in range(3)]) == (12, 4, [4, 4, 4])
    assert [g.global_micro_index(r, m) for r in range(3) for m in range(4)] == list(range(12))
    assert g.sample_range(1, 2) == range(12, 14)


@pytest.mark.parametrize(
    ("world", "shares"),
    [(5, [3, 3, 2, 2, 2]), (7, [2, 2, 2, 2, 2, 1, 1]), (12, [1] * 12), (14, [1] * 12 + [0, 0])],
)
def test_uneven_shares_differ_by_one_and_keep_the_order(world: int, shares: list[int]) -> None:
    g = BatchGeometry(global_batch=24, micro_batch=2, world_size=world)
    assert [g.share(r) for r in range(world)] == shares and g.accum_steps == max(shares)
    order = [g.global_micro_index(r, m) for r in range(world) for m in range(g.share(r))]
    assert order == list(range(12))  # rank-major blocks: the global micro-batch order


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"world_size": 0}, "world_size=0 must be a positive int"),
        ({"micro_batch": 5}, "global_batch=24 must be a multiple of micro_batch=5"),
        ({"global_batch": -1}, "global_batch=-1 must be a positive int"),
    ],
)
def test_geometry_refuses_what_cannot_work(kw: dict, message: str) -> None:
    args = {"global_batch": 24, "micro_batch": 2, "world_size": 3, **kw}
    with pytest.raises(ValueError, match=message):
        BatchGeometry(**args)


def test_bad_sampler_arguments() -> None:
    with pytest.raises(ValueError, match="num_samples=0"):
        GlobalSampler(0)
    with pytest.raises(ValueError, match="position=-1"):
        GlobalSampler(5).index(-1)
    g = BatchGeometry(global_batch=4, micro_batch=1, world_size=2)
    with pytest.raises(ValueError, match="rank=2"):
        RankBatchSampler(GlobalSampler(5), g, 2)
    with pytest.raises(ValueError, match="micro=2"):
        g.sample_range(0, 2)
    with pytest.raises(ValueError, match="micro=0 must be in \\[0, share=0\\) of rank 4"):
        BatchGeometry(global_batch=4, micro_batch=1, world_size=5).sample_range(4, 0)
    with pytest.raises(TypeError, match="infinite"):
        len(RankBatchSampler(GlobalSampler(5), g, 0))
