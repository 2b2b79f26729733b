"""Engine options: one frozen dataclass the CLI, the Python API and the server all fill, checked once.

The environment is read here and nowhere else ($MOESTREAM_STREAM, $MOESTREAM_DELTANET, whether torch's allocator
is configured): once, when the options are made, so a bad value fails at load and later changes to the
environment change nothing. The one exception is the C matvec's first build (kernels/cpu_quant.py), which
honours $CC and $XDG_CACHE_HOME as any C build does.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError
from moestream.offload.placement import parse_size
from moestream.offload.schedule import Schedule
from moestream.offload.small_batch import SmallBatch
from moestream.ops.delta_rule import DELTANET_ENV, deltanet_mode

MAX_THREADS_PER_CORE = 4  # --threads above this many a core only slows (and past ~30000 threads cannot start)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    ubatch: int = 512  # tokens per prefill micro-batch
    n_ctx: int = 4096  # context size (clipped to the model's training context; 0: that context, as llama.cpp)
    n_seqs: int = 1  # sequences held at once, each with its own KV cache, all within --vram-budget (the
    # server's --max-seqs)
    progress: bool = True  # progress bars for load and long prefill
    n_cpu_moe: int | str = 0  # experts of layers 0..N-1 stay in host RAM; "all" or "auto" (with vram_budget)
    streamed_layers: str = "first"  # first: layers 0..N-1, as llama.cpp; spread: N layers evenly spaced
    vram_budget: int | str | None = None  # cap on GPU bytes: weights + KV cache + staging + workspace
    expandable_segments: bool | None = None  # under a budget, turn on the allocator's expandable segments
    # (default: yes, unless $PYTORCH_CUDA_ALLOC_CONF or $PYTORCH_ALLOC_CONF configure the allocator)
    stream: Schedule | str | None = None  # serial | pinned | overlap | layer-major, made a Schedule (default:
    # $MOESTREAM_STREAM or overlap)
    slots: int = 3  # staging slots in the ring
    stream_min_batch: int = 32  # smaller micro-batches do not upload whole layers: see small_batch
    small_batch: SmallBatch | str = "auto"  # below stream_min_batch: upload, gather or cpu (made a SmallBatch;
    # auto: decided by offload/small_batch.py once placement knows what is page-locked)
    prefetch: int | None = None  # experts of a gathered layer guessed one layer ahead in decode (0: off; None:
    # as many as the router picks)
    expert_cache: int | str = "auto"  # experts of each streamed layer kept on the GPU for decode's gathers
    # (offload/expert_cache.py; with prefetch). auto: as many as --vram-budget leaves (none without a budget)
    host_memory: str = "pinned"  # streamed experts: "pinned" (page-locked in place) or "pageable" (llama.cpp's mmap)
    threads: int | None = None  # CPU threads for CPU work (torch's intra-op pool); None: torch's default
    deltanet: str | None = None  # delta-net prefill rule: torch | fla | auto (default: $MOESTREAM_DELTANET or auto)
    devices: str | tuple[str, ...] | None = None  # "cuda:0,cuda:1": streamed experts split over these (expert
    # parallel); the first is the compute device. None: --device alone
    tensor_split: str | tuple[float, ...] | None = None  # weights of the experts each of devices gets (default: even)

    def __post_init__(self) -> None:
        def resolve(name: str, value) -> None:  # frozen: fields are settled here, once
            object.__setattr__(self, name, value)

        if self.devices is not None:
            self._resolve_devices(resolve)
        elif self.tensor_split is not None:
            raise MoestreamError("--tensor-split splits experts over --devices: give --devices too")
        if self.device == "auto":
            resolve("device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise MoestreamError(f"--device {self.device}: expected cpu, cuda or cuda:N")
        if self.device != "cpu" and not torch.cuda.is_available():
            raise MoestreamError(f"--device {self.device}: no CUDA GPU is visible to torch; use --device cpu")
        if self.device.startswith("cuda:"):
            _visible("--device", self.device, [self.device])
        if self.dtype == "auto":
            resolve("dtype", "float32" if self.device == "cpu" else "bfloat16")
        if self.dtype not in DTYPES:
            raise MoestreamError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")
        if self.ubatch < 1:
            raise MoestreamError(f"--ubatch {self.ubatch}: must be at least 1")
        if self.n_seqs < 1:
            raise MoestreamError(f"--max-seqs {self.n_seqs}: must be at least 1")
        if self.n_ctx < 0:
            raise MoestreamError(f"--ctx {self.n_ctx}: must be at least 1 (or 0 for the model's own context)")
        resolve(
            "stream",
            Schedule.parse(
                (os.environ.get("MOESTREAM_STREAM", "").strip() or "overlap") if self.stream is None else self.stream
            ),
        )
        if self.slots < 2 and self.stream.overlaps:
            raise MoestreamError(f"--slots {self.slots}: {self.stream} needs at least 2 staging slots")
        if self.streamed_layers not in ("first", "spread"):
            raise MoestreamError(f"--streamed-layers {self.streamed_layers}: expected first or spread")
        resolve("small_batch", SmallBatch.parse(self.small_batch, len(self.devices or ())))
        if self.prefetch is not None and self.prefetch < 0:
            raise MoestreamError(f"--prefetch {self.prefetch}: must be 0 (off) or more experts a layer")
        if self.expert_cache != "auto":
            try:
                resolve("expert_cache", int(self.expert_cache))
            except ValueError:
                raise MoestreamError(f"--expert-cache {self.expert_cache}: expected an expert count or auto") from None
            if self.expert_cache < 0:
                raise MoestreamError(f"--expert-cache {self.expert_cache}: must be 0 (off), more experts or auto")
        if self.host_memory not in ("pinned", "pageable"):
            raise MoestreamError(f"--host-memory {self.host_memory}: expected pinned or pageable")
        if self.expandable_segments is None:
            resolve("expandable_segments", not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & os.environ.keys())
        resolve("deltanet", deltanet_mode(os.environ.get(DELTANET_ENV) if self.deltanet is None else self.deltanet))
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS_PER_CORE * (os.cpu_count() or 1):
            raise MoestreamError(
                f"--threads {self.threads}: give 1 to {MAX_THREADS_PER_CORE * (os.cpu_count() or 1)} "
                f"({os.cpu_count()} cores here)"
            )
        if self.stream_min_batch < 1:
            raise MoestreamError(f"--stream-min-batch {self.stream_min_batch}: must be at least 1")
        if isinstance(self.n_cpu_moe, str) and self.n_cpu_moe not in ("auto", "all"):
            try:
                resolve("n_cpu_moe", int(self.n_cpu_moe))
            except ValueError:
                raise MoestreamError(f"--n-cpu-moe {self.n_cpu_moe}: expected a layer count, all or auto") from None

        if isinstance(self.n_cpu_moe, int) and self.n_cpu_moe < 0:
            raise MoestreamError(f"--n-cpu-moe {self.n_cpu_moe}: must be 0 or more (a layer count), all or auto")
        if self.n_cpu_moe == "auto" and self.vram_budget is None:  # now, not after the dense weights (or a bench row)
            raise MoestreamError("--n-cpu-moe auto needs --vram-budget SIZE to know what fits")
        if self.vram_budget is not None:
            parse_size(self.vram_budget)  # a bad size is an error now, not after loading the model
            if self.device == "cpu":
                warnings.warn(
                    "--vram-budget with --device cpu only decides which layers stream (as if the CPU were the "
                    "GPU); no memory is capped",
                    stacklevel=3,
                )

    def _resolve_devices(self, resolve) -> None:
        """--devices and --tensor-split: one kind of device, each once, as many weights as devices."""
        names = tuple(d.strip() for d in self.devices.split(",")) if isinstance(self.devices, str) else self.devices
        names = tuple(re.sub(r"^cuda(\d+)$", r"cuda:\1", d.lower()) for d in names)  # llama.cpp says CUDA0
        shown = ",".join(names)
        if not names or any(d != "cpu" and not re.fullmatch(r"cuda:\d+", d) for d in names):
            raise MoestreamError(f"--devices {shown}: expected a comma list of cuda:N (or cpu, to simulate)")
        cpus = names.count("cpu")  # cpu,cpu simulates two devices; GPUs must differ and not mix with cpu
        if cpus != len(names) and (cpus or len(set(names)) < len(names)):
            raise MoestreamError(f"--devices {shown}: give distinct GPUs (cuda:0,cuda:1), or only cpu")
        if names[0] != "cpu":
            _visible("--devices", shown, names)
        if self.device not in ("auto", names[0]):
            raise MoestreamError(f"--device {self.device} and --devices {shown}: the first of --devices computes")
        split = self.tensor_split
        try:
            split = tuple(float(w) for w in split.split(",")) if isinstance(split, str) else split
        except ValueError:
            raise MoestreamError(f"--tensor-split {self.tensor_split}: expected comma-separated weights") from None
        split = split or (1.0,) * len(names)
        if len(split) != len(names) or not all(0 <= w < math.inf for w in split) or not 0 < sum(split) < math.inf:
            raise MoestreamError(
                f"--tensor-split {','.join(map(str, split))}: expected {len(names)} non-negative weights, finite and "
                "not all 0 (one a device of --devices)"
            )
        resolve("devices", names)
        resolve("tensor_split", split)
        resolve("device", names[0])

    def context(self, n_ctx_train: int) -> int:
        """The positions a sequence gets: n_ctx (0: all the model was trained for), at most n_ctx_train."""
        return min(self.n_ctx or n_ctx_train, n_ctx_train)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _visible(flag: str, shown: str, names: list[str] | tuple[str, ...]) -> None:
    """Each cuda:N of names is a GPU torch sees, said before a larger index reaches torch."""
    count = torch.cuda.device_count()
    if any(int(d.split(":")[1]) >= count for d in names):
        which = f", cuda:0 to cuda:{count - 1}" if count else ""
        raise MoestreamError(f"{flag} {shown}: torch sees {count} GPU(s){which}")
