"""kernels/gather.py: a batch's picks read each expert once (first_picks), in the kernel too."""

from __future__ import annotations

import torch
from kernel_devices import DEVICE, gpu_or_interpreter

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
