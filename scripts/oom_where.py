"""Where the GPU memory was when a moestream command ran out of it (issue 36): runs the command in this process
with torch's allocation history on and, at the first out-of-memory, prints the live allocations summed by the
moestream line that made them.

    python scripts/oom_where.py bench -m MODEL -p 16384 -n 0 -ub 2048 -ncmoe auto --vram-budget 12GiB -r 1
"""

from __future__ import annotations

import collections
import sys

import torch

from moestream.cli.main import main

MIB = 2**20


def where(frames: list[dict]) -> str:
    """The innermost two moestream frames of an allocation's stack (its maker and that one's caller)."""
    ours = [
        f"{f['filename'].split('moestream/')[-1]}:{f['line']} {f['name']}"
        for f in frames
        if "/moestream/" in f["filename"]
    ]
    return " < ".join(ours[:2]) or "(outside moestream)"


def on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    sizes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                key = where(block.get("frames", []))
                sizes[key] += block["size"]
                counts[key] += 1
    print(f"oom_where: asked {alloc / MIB:.1f} MiB with {sum(sizes.values()) / MIB:.1f} MiB live:", file=sys.stderr)
    for key, size in sizes.most_common(30):
        print(f"  {size / MIB:9.1f} MiB {counts[key]:6d} blocks  {key}", file=sys.stderr)
    sys.stderr.flush()


if __name__ == "__main__":
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    sys.exit(main(sys.argv[1:]))
