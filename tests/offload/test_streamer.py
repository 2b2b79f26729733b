"""The staging ring on the CPU device: real copy thread, injected delays, slots never overwritten in use."""

from __future__ import annotations

import time

import pytest
import torch

from moestream.offload.device import CpuDevice
from moestream.offload.streamer import HostLayer, Streamer
from moestream.options import Schedule


def host_layers(n: int) -> dict[int, HostLayer]:
    g = torch.Generator().manual_seed(0)
    return {
        il: HostLayer(
            [
                torch.randint(0, 255, (3, 100 + il), generator=g, dtype=torch.uint8),
                torch.randint(0, 255, (2, 77), generator=g, dtype=torch.uint8),
            ]
        )
        for il in range(n)
    }


@pytest.mark.parametrize("n_slots", [2, 3, 5])
@pytest.mark.parametrize("copy_delay,compute_delay", [(0.0, 0.0), (0.01, 0.0), (0.0, 0.01), (0.005, 0.005)])
def test_slots_hold_the_right_bytes_while_in_use(n_slots, copy_delay, compute_delay):
    layers = host_layers(6)
    dev = CpuDevice(copy_delay_s=copy_delay, compute_delay_s=compute_delay)
    s = Streamer(dev, layers, Schedule.OVERLAP, n_slots)
    visits = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    s.begin(visits)
    for il in visits:
        views = s.acquire(il)
        dev.compute()
        first = [v.clone() for v in views]
        time.sleep(0.003)  # a slow consumer: prefetches run meanwhile on the copy thread
        for v, expected, again in zip(views, layers[il].parts, first, strict=True):
            assert torch.equal(v, expected), f"layer {il}: slot holds other bytes"
            assert torch.equal(v, again), f"layer {il}: slot overwritten while in use"
    s.finish()
    dev.synchronize()
    dev.close()
    assert len(set(visits)) <= s.uploads <= len(visits)  # a layer still in a slot is not uploaded again


def test_uploads_run_ahead_of_compute():
    """With K slots, K-1 uploads are queued beyond the layer in use: copies overlap compute."""
    layers = host_layers(4)
    dev = CpuDevice(copy_delay_s=0.02)
    s = Streamer(dev, layers, Schedule.OVERLAP, 3)
    s.begin([0, 1, 2, 3])
    s.acquire(0)
    assert {sl.layer for sl in s.slots} == {0, 1, 2}
    t0 = time.perf_counter()
    time.sleep(0.1)  # "compute" on layer 0 while 1 and 2 upload (2 copies of 20 ms each per layer)
    s.acquire(1)
    s.acquire(2)
    waited = time.perf_counter() - t0 - 0.1
    assert waited < 0.02, f"layers 1 and 2 should have uploaded during compute; waited {waited * 1e3:.0f} ms"
    s.finish()
    dev.close()


@pytest.mark.parametrize("schedule", [Schedule.SERIAL, Schedule.PINNED])
def test_serial_uses_one_slot_on_the_compute_thread(schedule):
    layers = host_layers(3)
    dev = CpuDevice()
    s = Streamer(dev, layers, schedule, 3)
    assert len(s.slots) == 1 and not s.overlap
    s.begin([0, 1, 2])
    for il in range(3):
        assert all(torch.equal(v, p) for v, p in zip(s.acquire(il), layers[il].parts, strict=True))
    s.finish()
    dev.close()


def test_a_failed_copy_is_raised_not_hung():
    """A copy that fails on the worker thread surfaces at the wait, fails the copies chained on it, and the
    device still closes."""
    dev = CpuDevice()
    bad = dev.copy([(torch.empty(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))], None)
    chained = dev.copy([(torch.empty(3, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))], bad)
    with pytest.raises(ValueError):
        dev.wait(bad)
    with pytest.raises(ValueError):
        dev.wait(chained)
    dev.synchronize()
    dev.close()


@pytest.mark.parametrize("n_slots", [2, 3])
def test_bounce_staging_on_cpu_threads(n_slots):
    """The registration-refused fallback: staging threads fill per-slot buffers, then one copy each."""
    layers = host_layers(5)
    dev = CpuDevice(copy_delay_s=0.002)
    s = Streamer(dev, layers, Schedule.OVERLAP, n_slots, bounce=True)
    visits = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    s.begin(visits)
    for il in visits:
        views = s.acquire(il)
        time.sleep(0.002)  # compute holds the slot while the next layers stage
        assert all(torch.equal(v, p) for v, p in zip(views, layers[il].parts, strict=True)), f"layer {il}"
    s.close()
    dev.close()


def test_release_frees_the_slot_when_compute_moves_on():
    """A streamed layer's slot is freed when the next layer starts, resident or not, and the next upload is
    queued right then: with resident layers between streamed ones, it does not wait a layer's compute."""
    layers = host_layers(6)
    dev = CpuDevice()
    s = Streamer(dev, layers, Schedule.OVERLAP, 2)
    s.begin([0, 2, 4])  # layers 1, 3, 5 resident
    s.acquire(0)
    assert {sl.layer for sl in s.slots} == {0, 2}
    s.release(0)  # the same layer (say its next micro-batch, layer-major): still in use
    assert s.current is not None and s.current.layer == 0
    s.release(1)  # resident layer 1 starts: layer 0's slot is free and layer 4 goes up into it
    assert s.current is None
    assert {sl.layer for sl in s.slots} == {2, 4}
    for il in (2, 4):
        assert all(torch.equal(v, p) for v, p in zip(s.acquire(il), layers[il].parts, strict=True))
    s.finish()
    dev.close()


def test_forgetting_the_slots_uploads_every_layer_again():
    """After a failed graph capture the slots' events are unusable: forget() empties the ring, and the next
    pass uploads what it needs (the right bytes) instead of trusting a slot."""
    layers = host_layers(3)
    dev = CpuDevice()
    s = Streamer(dev, layers, Schedule.OVERLAP, 2)
    s.begin([0, 1])
    s.acquire(0)
    s.acquire(1)
    uploads = s.uploads
    s.forget()
    assert all(slot.layer is None and slot.ready is None and slot.free is None for slot in s.slots)
    s.begin([1])
    views = s.acquire(1)
    assert s.uploads == uploads + 1  # layer 1 was in a slot; forgotten, it comes again
    assert all(torch.equal(v, e) for v, e in zip(views, layers[1].parts, strict=True))
    s.finish()
    dev.close()
