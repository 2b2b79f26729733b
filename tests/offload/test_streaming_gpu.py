"""Streaming on CUDA: every schedule bit-identical to all-resident; slots survive a slow consumer;
registration refused falls back to bounce buffers with one warning."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.offload.device import CudaDevice
from moestream.offload.host import PinnedRanges
from moestream.options import SmallBatch

pytestmark = pytest.mark.gpu
TOKENS = torch.randint(0, 1280, (96,), generator=torch.Generator().manual_seed(7)).tolist()


def logits(path, device_impl=None, **opts):
    e = moestream.load(path, device="cuda", ubatch=32, progress=False, device_impl=device_impl, **opts)
    try:
        return e.logits(TOKENS)
    finally:
        e.close()


class SlowConsumer(CudaDevice):
    """Compute spins for a while after each slot becomes ready, before the kernels that read it."""

    def wait(self, event) -> None:
        super().wait(event)
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time on the compute stream


@pytest.mark.parametrize("stream", ["serial", "pinned", "overlap", "layer-major"])
@pytest.mark.parametrize("slots", [2, 3])
def test_schedules_bit_identical_on_cuda(model_file, stream, slots):
    path = model_file("tiny", "Q4_K_M")
    ref = logits(path, n_cpu_moe=0)
    got = logits(path, n_cpu_moe="all", stream=stream, slots=slots)
    assert torch.equal(ref, got), f"{stream}/{slots}: max diff {(ref - got).abs().max():.3e}"


@pytest.mark.parametrize("n_cpu_moe", [0, "all"])
def test_kept_dequantized_stacks_bit_identical_on_cuda(model_file, n_cpu_moe):
    """--keep-dequantized: 96 tokens in 3 micro-batches reuse each layer's Triton-dequantized stacks."""
    path = model_file("tiny", "Q4_K_M")
    ref = logits(path, n_cpu_moe=n_cpu_moe, stream="layer-major")
    got = logits(path, n_cpu_moe=n_cpu_moe, stream="layer-major", keep_dequantized=True)
    assert torch.equal(ref, got), f"max diff {(ref - got).abs().max():.3e}"


@pytest.mark.parametrize("stream", ["overlap", "layer-major"])
def test_slot_not_overwritten_under_slow_consumer(model_file, stream):
    path = model_file("tiny-odd", "Q8_0")  # 3 layers through 2 slots: every slot is reused
    serial = logits(path, n_cpu_moe="all", stream="serial")
    slow = logits(path, device_impl=SlowConsumer(torch.device("cuda")), n_cpu_moe="all", stream=stream, slots=2)
    assert torch.equal(serial, slow)


def test_registration_refused_falls_back_to_bounce_buffers(model_file):
    path = model_file("tiny", "Q4_K_M")
    e = moestream.load(path, device="cuda", ubatch=32, progress=False, n_cpu_moe=0)
    ref = e.logits(TOKENS)
    squatter = PinnedRanges()  # CUDA refuses to register the same pages of the same mapping twice
    assert squatter.register([t.data for t in e.source.tensors.values() if "_exps" in t.name])
    try:
        with pytest.warns(UserWarning, match="refused"):
            e.setup.reconfigure(n_cpu_moe="all", stream="overlap")
        assert e.offload.bounce
        got = e.logits(TOKENS)
    finally:
        e.close()
        squatter.unregister()
    assert torch.equal(ref, got)


@pytest.mark.parametrize("small_batch", ["upload", "gather", "cpu"])
def test_decode_with_streamed_layers(model_file, small_batch):
    """Decode (1-token batches) with every layer's experts in host RAM matches all-resident decode."""
    from moestream.runtime.sampling import SamplingParams

    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=16, stop_at_eos=False)
    ref = moestream.load(path, device="cuda", dtype="float32", ubatch=32, progress=False)
    got = moestream.load(
        path, device="cuda", dtype="float32", ubatch=32, progress=False, n_cpu_moe="all", small_batch=small_batch
    )
    a, b = ref.generate(TOKENS, params), got.generate(TOKENS, params)
    assert a.tokens == b.tokens
    if small_batch == "gather":
        assert not got.experts.pick.kernel_failed, "the kernel could not read host memory: decode picked on the host"
    ref.close()
    got.close()


def test_gather_reads_page_locked_host_memory(own_pages):
    """The gather kernel reads registered host pages directly: same bytes as indexing on the host, no warning."""
    import warnings

    import numpy as np

    from moestream.kernels import gather

    host = own_pages(np.random.default_rng(0).integers(0, 256, (64, 4, 630), dtype=np.uint8))  # rows: Q6_K x 768
    pinned = PinnedRanges()
    assert pinned.register([host])
    try:
        src = torch.from_numpy(host)
        rows = torch.tensor([5, 0, 63, 5, 17], device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pick = gather.RowGather()
            got = pick(src, rows)
        assert got.is_cuda and not pick.kernel_failed
        assert torch.equal(got.cpu(), src[rows.cpu()])
    finally:
        pinned.unregister()


@pytest.mark.parametrize("down", [630 * 4, 630])  # an expert of 1260 words (16-byte loads) or 315 (4-byte)
@pytest.mark.parametrize("chunk", [2048, 512])  # words a side-gather program reads at once (tuning.gather_words)
def test_held_gathers_read_cache_rows_on_the_device_and_the_rest_from_the_host(own_pages, monkeypatch, down, chunk):
    """gather_held (the expert cache's prefetch read) of a batch's united guesses and fill_misses with a cache:
    every row the bytes of its expert, held ones read from the device stacks (a corrupted cache row shows),
    repeats of the union and an expert several rows missed read once, link bytes only for the rest; in 16-byte
    loads where every offset allows them."""
    import numpy as np

    from moestream.kernels import gather, tuning

    rng = np.random.default_rng(1)
    shapes = [(32, 3, 4096), (32, 3, 4096), (32, 2, down)]  # three stacks; rows of several gather chunks
    hosts = [own_pages(rng.integers(0, 256, sh, dtype=np.uint8)) for sh in shapes]
    pinned = PinnedRanges()
    assert pinned.register(hosts)
    try:
        srcs = [torch.from_numpy(h) for h in hosts]
        held = [3, 9, 30]  # the cache's rows hold these experts
        slot_of = torch.full((32,), -1, dtype=torch.long, device="cuda")
        slot_of[held] = torch.arange(3, device="cuda")
        stacks = [src[held].cuda() for src in srcs]
        rows = torch.tensor([[9, 1], [30, 9], [12, 1]], device="cuda")  # three rows' guesses
        guess, n_live = gather.union(rows.reshape(-1), 6)  # 9, 1, 30, 12, then two repeats
        outs = [torch.full((6 + 5, *src.shape[1:]), 7, dtype=torch.uint8, device="cuda") for src in srcs]
        counts = torch.zeros(5, dtype=torch.long, device="cuda")
        offs = torch.zeros((3, 6), dtype=torch.long, device="cuda")
        pick, quads = gather.RowGather(), []
        few = pick._few
        monkeypatch.setattr(pick, "_few", lambda *a, **k: (quads.append(k["quads"]), few(*a, **k)))
        with tuning.use(gather_words=chunk):
            pick.gather_held(srcs, guess, n_live, [o[:6] for o in outs], stacks, slot_of, counts, offs, 16)
        assert quads == [down == 630 * 4] * 3  # an expert of 2 * down bytes: a multiple of 16 bytes, or not
        expert_bytes = sum(src[0].numel() for src in srcs)
        for src, out in zip(srcs, outs, strict=True):
            assert torch.equal(out[:4].cpu(), src[guess[:4].cpu()]) and (out[4:6] == 7).all(), "repeats not read"
        assert counts.tolist() == [0, 0, 0, 2 * expert_bytes, 0]  # 1 and 12 crossed the link
        picks = torch.tensor([12, 3, 5, 5, 3], device="cuda")  # guessed, held miss, host miss (twice each)
        first = gather.first_picks(picks)
        mats = torch.zeros(5, dtype=torch.long, device="cuda")
        freq = torch.zeros(32, dtype=torch.long, device="cuda")
        for s, (src, out) in enumerate(zip(srcs, outs, strict=True)):
            stack = stacks[s]
            stack[0].zero_()  # expert 3's cached rows: a miss of 3 must come from here
            gather.fill_misses(src, picks, first, guess, n_live, out, mats, counts, s == 0, (stack, slot_of), freq)
            got = out[mats].cpu()
            assert torch.equal(got[0], src[12]) and torch.equal(got[2], src[5]) and torch.equal(got[3], src[5])
            assert int(got[1].sum()) == int(got[4].sum()) == 0 and (out[6 + 3 :] == 7).all(), "read once"
        assert mats.tolist() == [3, 7, 8, 8, 7]
        assert counts.tolist() == [5, 4, expert_bytes, 2 * expert_bytes, 2]  # only 5 crossed the link, once
        assert freq[[12, 3, 5]].tolist() == [1, 2, 2] and int(freq.sum()) == 5
        assert not pick.kernel_failed
    finally:
        pinned.unregister()


def test_vram_cap_turns_on_expandable_segments():
    """Under a budget, fresh allocations land in segments that grow in place, so no reserved memory is stranded."""
    from moestream.offload.device import cap_vram

    dev = torch.device("cuda")
    cap_vram(dev, torch.cuda.get_device_properties(0).total_memory // 2, expandable=True)
    try:
        torch.cuda.empty_cache()
        x = torch.empty(300 << 20, dtype=torch.uint8, device=dev)
        ptr = x.data_ptr()
        segments = torch.cuda.memory._snapshot()["segments"]
        (seg,) = [s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]]
        assert seg["is_expandable"]
    finally:
        cap_vram(dev, None)
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")


@pytest.mark.parametrize("stream", ["overlap", "serial"])
def test_small_batch_auto_gathers_where_the_gpu_reads_the_host(model_file, stream):
    """auto offers the gather kernel only when the streamed experts are page-locked, and keeps the way it
    measured fastest (on the H200 gathering wins where offered; uploading and the CPU are close on the tiny
    model, so which of them wins under serial is the measurement's to say)."""
    e = moestream.load(model_file("tiny", "Q4_K_M"), device="cuda", n_cpu_moe="all", stream=stream, progress=False)
    try:
        plan = e.experts.plan
        seconds = plan.measured.seconds
        assert (SmallBatch.GATHER in seconds) == (stream == "overlap")
        assert plan.way == plan.measured.chosen == min(seconds, key=seconds.__getitem__)
        assert stream == "serial" or plan.way == SmallBatch.GATHER
    finally:
        e.close()
