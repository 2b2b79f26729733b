"""kernels/gather.py: a batch's picks read each expert once (first_picks), in the kernel too."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICE, INTERPRETED, gpu_or_interpreter

from moestream.kernels import gather


def test_first_picks_names_each_experts_first_pick():
    picks = torch.tensor([5, 2, 5, 7, 2, 2, 0])
    first = gather.first_picks(picks)
    assert first.tolist() == [0, 1, 0, 3, 1, 1, 6]
    assert torch.equal(picks[first], picks)  # a pick's row holds its expert
    assert gather.first_picks(torch.arange(4)).tolist() == [0, 1, 2, 3]


@gpu_or_interpreter
def test_the_kernel_reads_only_each_experts_first_pick():
    src = torch.randint(0, 255, (8, 3 * 4 * gather.WORDS_PER_PROGRAM + 12), dtype=torch.uint8, device=DEVICE)
    picks = torch.tensor([3, 6, 3, 1, 6, 3], device=DEVICE)
    first = gather.first_picks(picks)
    out = torch.full((picks.numel(), src.shape[1]), 7, dtype=torch.uint8, device=DEVICE)
    words = src.shape[1] // 4
    launch = gather._gather_kernel[(picks.numel(), -(-words // gather.WORDS_PER_PROGRAM))]
    launch(gather._words(src), picks, gather._words(out), words, first, WORDS=gather.WORDS_PER_PROGRAM, DEDUP=True)
    read = first == torch.arange(picks.numel(), device=DEVICE)
    assert torch.equal(out[read], src[picks[read]])
    assert (out[~read] == 7).all(), "a repeated pick's row is not read"
    assert torch.equal(out[first], src[picks])  # what the math reads through first


def test_copy_rows_writes_only_the_rows_it_names():
    """The expert cache's admissions: rows copied where the destination is named, nothing else touched (the
    kernel on a GPU or under the interpreter, indexing elsewhere)."""
    src = torch.randint(0, 255, (6, 4 * gather.WORDS_PER_PROGRAM + 8), dtype=torch.uint8, device=DEVICE)
    dst = torch.full((4, src.shape[1]), 7, dtype=torch.uint8, device=DEVICE)
    gather.copy_rows(src, torch.tensor([5, 0, 2], device=DEVICE), dst, torch.tensor([2, -1, 0], device=DEVICE))
    assert torch.equal(dst[2], src[5]) and torch.equal(dst[0], src[2])
    assert (dst[[1, 3]] == 7).all()


def test_a_union_names_each_guessed_expert_once_then_repeats_them():
    guesses = torch.tensor([[3, 9, 5], [9, 3, 12], [5, 3, 9]])  # three rows' guesses
    ids, n_live = gather.union(guesses.reshape(-1), 8)
    assert int(n_live) == 4 and ids[:4].tolist() == [3, 9, 5, 12]
    assert set(ids[4:].tolist()) <= {3, 9, 5, 12}  # a fixed width, padded with real ids
    ids, n_live = gather.union(torch.tensor([4, 1]), 2)  # one row: its guess as it is
    assert ids.tolist() == [4, 1] and int(n_live) == 2


@pytest.mark.skipif(not INTERPRETED, reason="host stacks read as a GPU reads page-locked ones: the interpreter")
def test_a_batchs_guesses_and_misses_read_each_expert_once():
    """Where a union's guesses are read (held ones from the cache, repeats nowhere) and fill_misses for picks
    several rows share: each missed expert read once, from the cache where it holds it, every pick indexing its
    expert's bytes, and the link bytes of what crossed it once. (The gathers reading those offsets loop over a
    runtime count, which the interpreter cannot: tests/offload/test_streaming_gpu.py runs them on CUDA.)"""
    words = gather.WORDS_PER_PROGRAM
    srcs = [torch.randint(0, 255, (16, n), dtype=torch.uint8) for n in (2 * 4 * words + 8, 4 * words, 12)]
    guess, n_live = gather.union(torch.tensor([3, 9, 5, 9, 3, 12, 5, 3, 9]), 8)  # three rows' guesses
    held = [5, 1]  # the cache's rows hold these
    slot_of = torch.full((16,), -1, dtype=torch.long)
    slot_of[held] = torch.arange(2)
    stacks = [src[held].clone() for src in srcs]
    counts, offs = torch.zeros(5, dtype=torch.long), torch.zeros((3, 8), dtype=torch.long)
    w = [src[0].numel() // 4 for src in srcs]
    expert_bytes = 4 * sum(w)
    d = [1000, -2000, 3000]  # the cache's rows seen from each host stack's base (words): above or below it
    gather._held_offsets_kernel[(1,)](guess, n_live, slot_of, offs, counts, 8, *w, *d, expert_bytes, GUESS=8)
    for s in range(3):
        assert offs[s].tolist() == [3 * w[s], 9 * w[s], d[s], 12 * w[s]] + [gather.UNREAD] * 4, (
            "held from the cache (below the host base too), repeats unread"
        )
    assert counts.tolist() == [0, 0, 0, 3 * expert_bytes, 0]  # 3, 9 and 12 crossed the link, 5 is held
    picks = torch.tensor([9, 7, 7, 2, 5, 7, 1, 1])  # guessed; missed by three rows; missed; held and guessed;
    # held and missed by two rows
    outs = [torch.full((8 + picks.numel(), *src.shape[1:]), 7, dtype=torch.uint8) for src in srcs]
    first, mats, freq = gather.first_picks(picks), torch.zeros(8, dtype=torch.long), torch.zeros(16, dtype=torch.long)
    for s, (src, out) in enumerate(zip(srcs, outs, strict=True)):
        out[:4] = src[guess[:4]]  # what the gathers read
        stacks[s][1].zero_()  # expert 1's cached rows: its misses must come from here
        gather.fill_misses(src, picks, first, guess, n_live, out, mats, counts, s == 0, (stacks[s], slot_of), freq)
        got = out[mats]
        assert torch.equal(got[:6], src[picks[:6]]) and int(got[6:].sum()) == 0
        assert (out[8 + torch.tensor([0, 2, 4, 5, 7])] == 7).all(), "hits and repeated misses are not read"
    assert mats.tolist() == [1, 9, 9, 11, 2, 9, 14, 14]
    assert counts.tolist() == [8, 6, 2 * expert_bytes, 3 * expert_bytes, 3]  # 7 and 2 crossed the link, once each
    assert freq[[9, 7, 2, 5, 1]].tolist() == [1, 3, 1, 1, 2] and int(freq.sum()) == 8
