"""Options: what a run is told, grouped by what each group steers, settled once.

The CLI, the Python API (`moestream.load(path, n_cpu_moe=26, ...)`) and the server each build one `Options`
(`Options.make` from flat names, as the flags and keywords spell them); `replace` makes a changed copy for bench
rows and the server. The environment is read here and nowhere else ($MOESTREAM_STREAM, $MOESTREAM_DELTANET,
whether torch's allocator is configured): once, when the options are made, so a bad value fails at load and
later changes to the environment change nothing. (Builds honour their own: the C matvec's $CC and
$XDG_CACHE_HOME, Triton's $TRITON_INTERPRET, read once by kernels/launch.py.)
"""

from __future__ import annotations

import enum
import math
import os
import re
import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from moestream.errors import MoestreamError

if TYPE_CHECKING:
    import torch

MAX_THREADS_PER_CORE = 4  # --threads above this many a core only slows (and past ~30000 threads cannot start)
DTYPES = ("float32", "bfloat16", "float16")  # torch's names
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # -ctk/-ctv: llama.cpp's names (kernels/kv_quant.py stores them)
KV_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # a compute dtype's KV type (auto)
STREAM_ENV = "MOESTREAM_STREAM"  # the default --stream
DELTANET_ENV = "MOESTREAM_DELTANET"  # torch | fla | auto (default): qwen35moe's prefill delta rule
DELTANET_MODES = ("auto", "torch", "fla")


class Schedule(enum.Enum):
    """serial: copies from the pageable map on the compute stream, then compute (llama.cpp's way); pinned: the
    same from the page-locked map; overlap: uploads on a copy stream, up to K-1 layers ahead of compute;
    layer-major: overlap, with every micro-batch through layer L before L+1 (each layer crosses once)."""

    SERIAL = "serial"
    PINNED = "pinned"
    OVERLAP = "overlap"
    LAYER_MAJOR = "layer-major"

    def __str__(self) -> str:
        return self.value  # as the CLI spells it, in messages and reports

    @classmethod
    def parse(cls, text: str | Schedule, env: str | None = None) -> Schedule:
        """A --stream value (or, named by env, that variable's); anything else is a one-line error."""
        try:
            return cls(text)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            given = f"{env}={text}" if env else f"--stream {text}"
            raise MoestreamError(f"{given}: expected one of {choices}") from None

    @classmethod
    def default(cls) -> Schedule:
        """$MOESTREAM_STREAM, else layer-major: the same work as overlap for a prompt of one micro-batch, and each
        streamed layer read once (not once a micro-batch) for a longer one."""
        return cls.parse(os.environ.get(STREAM_ENV, "").strip() or "layer-major", STREAM_ENV)

    @property
    def overlaps(self) -> bool:
        """Uploads run on their own copy stream, ahead of compute (else on the compute stream, in turn)."""
        return self in (Schedule.OVERLAP, Schedule.LAYER_MAJOR)

    @property
    def page_locks(self) -> bool:
        """The streamed experts are page-locked in place (serial copies from the pageable map)."""
        return self is not Schedule.SERIAL

    def staging_slots(self, slots: int) -> int:
        """Staging slots allocated for --slots K: serial and pinned copy into one, overlap and layer-major into K."""
        return slots if self.overlaps else 1


class SmallBatch(enum.StrEnum):
    """--small-batch: upload just the chosen experts, gather them with a kernel reading the page-locked map,
    or compute them on the CPU straight from the map; auto decides (decode_plan)."""

    AUTO = "auto"
    UPLOAD = "upload"
    GATHER = "gather"
    CPU = "cpu"

    @classmethod
    def parse(cls, text: str | SmallBatch, n_devices: int = 1) -> SmallBatch:
        """A --small-batch value; anything else, or upload across several --devices, is a one-line error."""
        try:
            way = cls(text)
        except ValueError:
            raise MoestreamError(f"--small-batch {text}: expected one of {', '.join(m.value for m in cls)}") from None
        if n_devices > 1 and way is SmallBatch.UPLOAD:
            raise MoestreamError(
                "--small-batch upload with several --devices: small batches gather their experts on the first "
                "device or compute them on the cpu; use --small-batch gather, cpu or auto"
            )
        return way


def count_of(n: int, noun: str) -> str:
    """'1 token', '2 tokens': a count with its noun, for the lines a user reads."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_size(n: float) -> str:
    """A byte count as llama-bench prints sizes: GiB, MiB or KiB with two decimals (a tiny model is not
    0.00 GiB), whole bytes below one KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str | int | None) -> int | None:
    """'12GiB', '12G', '512MiB', '1e9' or a plain byte count."""
    if text is None or isinstance(text, int):
        return text
    t = text.strip().lower().replace(" ", "")
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 2**10,
        "m": 2**20,
        "g": 2**30,
        "t": 2**40,
        "b": 1,
    }
    for suffix, scale in units.items():
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], scale
            break
    else:
        mult = 1
    try:
        value = float(t) * mult
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise MoestreamError(f"--vram-budget {text!r}: expected a positive size like 12GiB, 8000MiB or 12e9")
    return int(value)


def deltanet_mode(text: str | None) -> str:
    """A $MOESTREAM_DELTANET value as a mode (unset or blank: auto, any case); anything else is a clear error."""
    mode = (text or "").strip().lower() or "auto"
    if mode not in DELTANET_MODES:
        raise MoestreamError(f"{DELTANET_ENV}={mode}: expected torch, fla or auto")
    return mode


@dataclass(frozen=True)
class ModelOptions:
    """Where and how the model computes."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    ubatch: int = 512  # tokens per prefill micro-batch
    n_ctx: int = 4096  # context size (clipped to the model's training context; 0: that context, as llama.cpp)
    threads: int | None = None  # CPU threads for CPU work (torch's intra-op pool); None: torch's default
    cache_type_k: str = "auto"  # the KV cache's K rows: one of KV_TYPES (-ctk); auto: dtype
    cache_type_v: str = "auto"  # and its V rows (-ctv)
    deltanet: str | None = None  # delta-net prefill rule: torch | fla | auto (default: $MOESTREAM_DELTANET or auto)
    progress: bool = True  # progress bars for load and long prefill

    def context(self, n_ctx_train: int) -> int:
        """The positions a sequence gets: n_ctx (0: all the model was trained for), at most n_ctx_train."""
        return min(self.n_ctx or n_ctx_train, n_ctx_train)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_types(self) -> tuple[str, str]:
        """The KV cache's (K, V) types, auto as the compute dtype's."""
        own = KV_NAMES.get(self.dtype, "auto")
        return tuple(own if t == "auto" else t for t in (self.cache_type_k, self.cache_type_v))


@dataclass(frozen=True)
class PlacementOptions:
    """Which experts live where, within what budget."""

    n_cpu_moe: int | str = 0  # experts of layers 0..N-1 stay in host RAM; "all" or "auto" (with vram_budget)
    streamed_layers: str = "first"  # first: layers 0..N-1, as llama.cpp; spread: N layers evenly spaced
    vram_budget: int | str | None = None  # cap on GPU bytes: weights + KV cache + staging + workspace
    expandable_segments: bool | None = None  # under a budget, turn on the allocator's expandable segments
    # (default: yes, unless $PYTORCH_CUDA_ALLOC_CONF or $PYTORCH_ALLOC_CONF configure the allocator)
    host_memory: str = "pinned"  # streamed experts: "pinned" (page-locked in place) or "pageable" (llama.cpp's mmap)
    devices: str | tuple[str, ...] | None = None  # "cuda:0,cuda:1": streamed experts split over these (expert
    # parallel); the first is the compute device. None: --device alone
    tensor_split: str | tuple[float, ...] | None = None  # weights of the experts each of devices gets (default: even)


@dataclass(frozen=True)
class StreamingOptions:
    """How streamed layers' uploads are ordered against compute (prefill)."""

    stream: Schedule | str | None = None  # serial | pinned | overlap | layer-major (default: $MOESTREAM_STREAM
    # or overlap)
    slots: int = 3  # staging slots in the ring
    stream_min_batch: int = 32  # smaller micro-batches do not upload whole layers: the decode options say how
    keep_dequantized: bool = False  # layer-major prefill keeps a layer's dequantized expert stacks for all its
    # micro-batches: one dequantization a layer a prompt, for a workspace of three stacks, not one

    def keeps_dequantized(self, n_tokens: int, ubatch: int) -> bool:
        """Whether a pass of n_tokens (settled options) keeps each layer's dequantized stacks across its
        micro-batches: asked for, layer-major, and more than one micro-batch."""
        return self.keep_dequantized and self.stream is Schedule.LAYER_MAJOR and n_tokens > ubatch


CACHE_POLICIES = ("static", "lru", "lfu")  # --cache-policy (offload/cache_policy.py)
PREFETCH_AHEAD = (1, 2)  # --prefetch-ahead: streamed layers between a guess and the layer it guesses


@dataclass(frozen=True)
class DecodeOptions:
    """How a streamed layer serves a few tokens (offload/small_batch.py turns these into a plan)."""

    small_batch: SmallBatch | str = "auto"  # upload, gather or cpu; auto: the rule, or measured at load
    prefetch: int | None = None  # experts of a gathered layer guessed ahead (0: off; None: as many as the router
    # picks)
    prefetch_ahead: int = 1  # the guess made at the start of the streamed layer 1 or 2 before (offload/prefetch.py)
    expert_cache: int | str = "auto"  # experts of each streamed layer kept on the GPU for decode's gathers
    # (offload/expert_cache.py; with prefetch). auto: as many as --vram-budget leaves (none without a budget)
    cache_policy: str = "lru"  # which experts that cache holds: static, lru or lfu (offload/cache_policy.py)
    cpu_layers: int = 0  # of the streamed layers, this many (evenly spaced) compute a few tokens' experts on the
    # CPU instead (the rest as small_batch says): the CPU's memory and the link work side by side
    measure_ways: bool = True  # auto times the ways at load unless an earlier load's choice is remembered; off:
    # the rule (a cold `run`, whose timing would compile every way's kernels for a few tokens)


PROMPT_CACHE_RAM_MIB = 8192  # host RAM for prompt prefixes by default: llama-server's --cache-ram


@dataclass(frozen=True)
class ServingOptions:
    """What the engine holds for a server."""

    n_seqs: int = 1  # sequences held at once, each with its own KV cache, all within --vram-budget (--max-seqs)


GROUPS = {
    "model": ModelOptions,
    "placement": PlacementOptions,
    "streaming": StreamingOptions,
    "decode": DecodeOptions,
    "serving": ServingOptions,
}
GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}  # flat name -> its group


@dataclass(frozen=True)
class Options:
    """Every option of a run, by group; made by `make` (flat names) and settled in __post_init__."""

    model: ModelOptions = ModelOptions()
    placement: PlacementOptions = PlacementOptions()
    streaming: StreamingOptions = StreamingOptions()
    decode: DecodeOptions = DecodeOptions()
    serving: ServingOptions = ServingOptions()

    @classmethod
    def make(cls, **flat: Any) -> Options:
        """Options from flat names (device=, n_cpu_moe=, stream=, ...), as the API and the CLI spell them."""
        return cls(**{g: GROUPS[g](**c) for g, c in _grouped(flat).items()})

    def replace(self, **flat: Any) -> Options:
        """A copy with the flat-named options changed, settled again (a settled value is not read again)."""
        return replace(self, **{g: replace(getattr(self, g), **c) for g, c in _grouped(flat).items() if c})

    @classmethod
    def check(cls, **flat: Any) -> None:
        """Every check of flat-named options that needs no torch: the CLI answers a bad value before the slow
        imports. (make runs the same checks, then settles the device.)"""
        _settled(**{g: GROUPS[g](**c) for g, c in _grouped(flat).items()})

    def __post_init__(self) -> None:
        def resolve(name: str, value) -> None:  # frozen: fields are settled here, once
            group = GROUP_OF[name]
            object.__setattr__(self, group, replace(getattr(self, group), **{name: value}))

        for name, value in _settled(**{g: getattr(self, g) for g in GROUPS}).items():
            resolve(name, value)
        if self.model.device == "auto":
            resolve("device", "cuda" if cuda_available() else "cpu")
        if self.placement.devices is not None and self.placement.devices[0] != "cpu":
            _visible("--devices", ",".join(self.placement.devices), self.placement.devices)
        if self.model.device != "cpu" and not cuda_available():
            raise MoestreamError(f"--device {self.model.device}: no CUDA GPU is visible to torch; use --device cpu")
        if self.model.device.startswith("cuda:") and self.placement.devices is None:
            _visible("--device", self.model.device, [self.model.device])
        if self.model.dtype == "auto":
            resolve("dtype", "float32" if self.model.device == "cpu" else "bfloat16")
        if self.placement.vram_budget is not None and self.model.device == "cpu":
            warnings.warn(
                "--vram-budget with --device cpu only decides which layers stream (as if the CPU were the "
                "GPU); no memory is capped",
                stacklevel=2,
            )


def _settled(
    model: ModelOptions,
    placement: PlacementOptions,
    streaming: StreamingOptions,
    decode: DecodeOptions,
    serving: ServingOptions,
) -> dict[str, Any]:
    """Check every value that needs no torch; give the settled form of those that have one (by flat name)."""
    settled: dict[str, Any] = {}
    if placement.devices is not None:
        settled.update(_devices(placement, model.device))
    elif placement.tensor_split is not None:
        raise MoestreamError("--tensor-split splits experts over --devices: give --devices too")
    device = settled.get("device", model.device)
    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        raise MoestreamError(f"--device {device}: expected cpu, cuda or cuda:N")
    if model.dtype not in ("auto", *DTYPES):
        raise MoestreamError(f"--dtype {model.dtype}: expected one of {', '.join(DTYPES)}")
    for flag, name in (("--cache-type-k", "cache_type_k"), ("--cache-type-v", "cache_type_v")):
        value = getattr(model, name).strip().lower()
        if value not in ("auto", *KV_TYPES):
            raise MoestreamError(f"{flag} {getattr(model, name)}: expected one of {', '.join(KV_TYPES)}")
        settled[name] = value
    if model.ubatch < 1:
        raise MoestreamError(f"--ubatch {model.ubatch}: must be at least 1")
    if serving.n_seqs < 1:
        raise MoestreamError(f"--max-seqs {serving.n_seqs}: must be at least 1")
    if model.n_ctx < 0:
        raise MoestreamError(f"--ctx {model.n_ctx}: must be at least 1 (or 0 for the model's own context)")
    stream = Schedule.default() if streaming.stream is None else Schedule.parse(streaming.stream)
    settled["stream"] = stream
    if streaming.slots < 2 and stream.overlaps:
        raise MoestreamError(f"--slots {streaming.slots}: {stream} needs at least 2 staging slots")
    if placement.streamed_layers not in ("first", "spread"):
        raise MoestreamError(f"--streamed-layers {placement.streamed_layers}: expected first or spread")
    settled["small_batch"] = SmallBatch.parse(decode.small_batch, len(settled.get("devices") or ()))
    if decode.prefetch is not None and decode.prefetch < 0:
        raise MoestreamError(f"--prefetch {decode.prefetch}: must be 0 (off) or more experts a layer")
    if decode.cpu_layers < 0:
        raise MoestreamError(f"--cpu-layers {decode.cpu_layers}: must be 0 (none) or more streamed layers")
    if decode.prefetch_ahead not in PREFETCH_AHEAD:
        raise MoestreamError(
            f"--prefetch-ahead {decode.prefetch_ahead}: give 1 (guess from the streamed layer before) or 2 (from the "
            "one two before)"
        )
    if decode.expert_cache != "auto":
        try:
            settled["expert_cache"] = int(decode.expert_cache)
        except ValueError:
            raise MoestreamError(f"--expert-cache {decode.expert_cache}: expected an expert count or auto") from None
        if settled["expert_cache"] < 0:
            raise MoestreamError(f"--expert-cache {decode.expert_cache}: must be 0 (off), more experts or auto")
    if decode.cache_policy not in CACHE_POLICIES:
        raise MoestreamError(f"--cache-policy {decode.cache_policy}: choose {', '.join(CACHE_POLICIES)}")
    if placement.host_memory not in ("pinned", "pageable"):
        raise MoestreamError(f"--host-memory {placement.host_memory}: expected pinned or pageable")
    if placement.expandable_segments is None:
        settled["expandable_segments"] = not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & os.environ.keys()
    settled["deltanet"] = deltanet_mode(os.environ.get(DELTANET_ENV) if model.deltanet is None else model.deltanet)
    most = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if model.threads is not None and not 1 <= model.threads <= most:
        raise MoestreamError(f"--threads {model.threads}: give 1 to {most} ({os.cpu_count()} cores here)")
    if streaming.stream_min_batch < 1:
        raise MoestreamError(f"--stream-min-batch {streaming.stream_min_batch}: must be at least 1")
    n_cpu_moe = placement.n_cpu_moe
    if isinstance(n_cpu_moe, str) and n_cpu_moe not in ("auto", "all"):
        try:
            n_cpu_moe = settled["n_cpu_moe"] = int(n_cpu_moe)
        except ValueError:
            raise MoestreamError(f"--n-cpu-moe {n_cpu_moe}: expected a layer count, all or auto") from None
    if isinstance(n_cpu_moe, int) and n_cpu_moe < 0:
        raise MoestreamError(f"--n-cpu-moe {n_cpu_moe}: must be 0 or more (a layer count), all or auto")
    if n_cpu_moe == "auto" and placement.vram_budget is None:  # now, not after the dense weights (or a bench row)
        raise MoestreamError("--n-cpu-moe auto needs --vram-budget SIZE to know what fits")
    parse_size(placement.vram_budget)  # a bad size is an error now, not after loading the model
    return settled


def _devices(placement: PlacementOptions, device: str) -> dict[str, Any]:
    """--devices and --tensor-split: one kind of device, each once, as many weights as devices."""
    names = (
        tuple(d.strip() for d in placement.devices.split(","))
        if isinstance(placement.devices, str)
        else placement.devices
    )
    names = tuple(re.sub(r"^cuda(\d+)$", r"cuda:\1", d.lower()) for d in names)  # llama.cpp says CUDA0
    shown = ",".join(names)
    if not names or any(d != "cpu" and not re.fullmatch(r"cuda:\d+", d) for d in names):
        raise MoestreamError(f"--devices {shown}: expected a comma list of cuda:N (or cpu, to simulate)")
    cpus = names.count("cpu")  # cpu,cpu simulates two devices; GPUs must differ and not mix with cpu
    if cpus != len(names) and (cpus or len(set(names)) < len(names)):
        raise MoestreamError(f"--devices {shown}: give distinct GPUs (cuda:0,cuda:1), or only cpu")
    if device not in ("auto", names[0]):
        raise MoestreamError(f"--device {device} and --devices {shown}: the first of --devices computes")
    split = placement.tensor_split
    try:
        split = tuple(float(w) for w in split.split(",")) if isinstance(split, str) else split
    except ValueError:
        raise MoestreamError(f"--tensor-split {placement.tensor_split}: expected comma-separated weights") from None
    split = split or (1.0,) * len(names)
    if len(split) != len(names) or not all(0 <= w < math.inf for w in split) or not 0 < sum(split) < math.inf:
        raise MoestreamError(
            f"--tensor-split {','.join(map(str, split))}: expected {len(names)} non-negative weights, finite and "
            "not all 0 (one a device of --devices)"
        )
    return {"devices": names, "tensor_split": split, "device": names[0]}


def _grouped(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat-named options by group; a name no group has is the caller's typo, said as such."""
    unknown = sorted(set(flat) - GROUP_OF.keys())
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(GROUP_OF)}")
    return {g: {k: v for k, v in flat.items() if GROUP_OF[k] == g} for g in GROUPS}


# What a CUDA device needs from the system: the NVIDIA driver (Linux; /dev/dxg on WSL)
DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")


def driver_present() -> bool:
    """Whether a CUDA device can be there at all: without the driver, torch would see none."""
    return any(os.path.exists(p) for p in DRIVER_PATHS)


def cuda_available() -> bool:
    """torch.cuda.is_available(), asked only where a driver is there to find: without one torch says False, and
    its import (seconds) is spared, so `info` on a CPU machine stays torch-free."""
    if not driver_present():
        return False
    import torch

    return torch.cuda.is_available()


def _visible(flag: str, shown: str, names: list[str] | tuple[str, ...]) -> None:
    """Each cuda:N of names is a GPU torch sees, said before a larger index reaches torch."""
    import torch

    count = torch.cuda.device_count()
    if any(int(d.split(":")[1]) >= count for d in names):
        which = f", cuda:0 to cuda:{count - 1}" if count else ""
        raise MoestreamError(f"{flag} {shown}: torch sees {count} GPU(s){which}")
