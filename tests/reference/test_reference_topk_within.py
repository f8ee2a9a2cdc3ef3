"""``reference.topk_within``: the spot check's test that an engine's CSA selection is a causal top-k of the
reference's index scores up to a slack (near-ties from other score rounding pass; wrong selections fail)."""

from __future__ import annotations

import torch

from dsv4.reference import select_topk, topk_within

K, SLACK = 8, 2.0**-5


def _scores(T: int = 40, n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, n, generator=g)
    visible = torch.randint(0, n + 1, (T,), generator=g)
    return scores, visible


def test_exact_topk_passes_with_nonpositive_gap() -> None:
    scores, visible = _scores()
    got = select_topk(scores, visible, K)
    ok, gap = topk_within(scores, visible, got, K, SLACK)
    assert bool(ok.all()) and bool((gap <= 0).all())


def test_near_tie_swap_passes_and_clear_swap_fails() -> None:
    scores, _ = _scores(T=1, n=64, seed=1)
    visible = torch.tensor([64])
    got = select_topk(scores, visible, K)
    order = scores[0].argsort(descending=True)
    kth, next_best, far = order[K - 1], order[K], order[40]
    swapped = got.clone()
    swapped[got == kth] = next_best
    # make the left-out k-th entry a near-tie of the one taken instead: within the slack of the row's scale
    scale = scores[0].abs().max()
    near = scores.clone()
    near[0, kth] = near[0, next_best] + 0.5 * SLACK * scale
    assert bool(topk_within(near, visible, swapped, K, SLACK)[0].all())
    clear = got.clone()
    clear[got == kth] = far  # a clearly worse entry taken, the k-th left out
    ok, gap = topk_within(scores, visible, clear, K, SLACK)
    assert not bool(ok.any()) and float(gap[0]) > SLACK


def test_future_duplicate_and_missing_entries_fail() -> None:
    scores, _ = _scores(T=1, n=64, seed=2)
    visible = torch.tensor([30])
    got = select_topk(scores, visible, K)
    future = got.clone()
    future[0, 0] = 40  # not visible (even with a high score)
    scores_f = scores.clone()
    scores_f[0, 40] = 100.0
    assert not bool(topk_within(scores_f, visible, future, K, SLACK)[0].any())
    dup = got.clone()
    dup[0, 1] = dup[0, 0]
    assert not bool(topk_within(scores, visible, dup, K, SLACK)[0].any())
    short = got.clone()
    short[0, -1] = -1
    assert not bool(topk_within(scores, visible, short, K, SLACK)[0].any())


def test_rows_seeing_fewer_than_k_must_take_all_they_see() -> None:
    scores, _ = _scores(T=1, n=64, seed=3)
    visible = torch.tensor([5])
    got = select_topk(scores, visible, K)  # 5 entries, then −1
    assert int((got >= 0).sum()) == 5 and bool(topk_within(scores, visible, got, K, SLACK)[0].all())
    got[0, 0] = -1
    assert not bool(topk_within(scores, visible, got, K, SLACK)[0].any())


def test_garbage_selection_fails_almost_every_row() -> None:
    """The failure the spot check exists for (e.g. scores never written): random visible entries."""
    scores, _ = _scores(T=200, n=256, seed=4)
    visible = torch.full((200,), 256)
    g = torch.Generator().manual_seed(5)
    got = torch.stack([torch.randperm(256, generator=g)[:K] for _ in range(200)])
    ok, _ = topk_within(scores, visible, got, K, SLACK)
    assert int(ok.sum()) <= 2
