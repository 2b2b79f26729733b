"""Pick experts' stored bytes out of a host tensor on the GPU, reading page-locked memory directly.

For small batches (decode) the host normally has to learn which experts the router chose (a sync per
streamed layer) before it can queue their copies. On a system with unified addressing, memory registered
with cudaHostRegister is readable from kernels at its host address, so one kernel can read the chosen
experts over PCIe itself, with the ids still on the GPU: no sync, and the host keeps queuing ahead.
If the kernel cannot read the memory (not registered, or no Triton), the picks go through the host.
"""

from __future__ import annotations

import enum
import warnings

import torch

from moestream.kernels import tuning
from moestream.kernels.launch import INTERPRETED, on_device

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:
    triton = None

WORDS_PER_PROGRAM = 2048
UNREAD = -(1 << 62)  # a row offset no read has (a device cache's rows may lie below a host base: negative)
Cached = tuple[torch.Tensor, torch.Tensor]  # a device stack of some experts' rows, and slot_of [n_expert]: each
# expert's row of it (-1: not held)


class Count(enum.IntEnum):
    """The slots of the int64 device counters decode's gathers add to without a host sync
    (offload/counters.py reads them back)."""

    PICKS = 0
    MISSES = 1  # picks the guess did not name, gathered after routing
    MISS_BYTES = 2  # bytes those read over the link
    GUESS_BYTES = 3  # bytes the guesses read over the link
    CACHED = 4  # picks the expert cache held


if triton is not None:
    _PICKS, _MISSES, _MISS_BYTES, _GUESS_BYTES, _CACHED = (tl.constexpr(c.value) for c in Count)
    _UNREAD = tl.constexpr(UNREAD)

    @triton.jit
    def _gather_kernel(src, ids, dst, row_words, first, WORDS: tl.constexpr, DEDUP: tl.constexpr):
        """Pick r's row of src into dst row r; with DEDUP only where first[r] == r (the first pick of its
        expert: the others' rows are not read, their picks index that row instead)."""
        r = tl.program_id(0)  # which pick
        w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        ok = w < row_words
        if DEDUP:
            ok = ok & (tl.load(first + r) == r)
        row = tl.load(ids + r).to(tl.int64)
        tl.store(dst + r.to(tl.int64) * row_words + w, tl.load(src + row * row_words + w, mask=ok), mask=ok)

    @triton.jit
    def _gather_few_kernel(
        src,
        ids,
        dst,
        row_words,
        n_items,
        chunks,
        WORDS: tl.constexpr,
        PROGRAMS: tl.constexpr,
        AT: tl.constexpr,
        QUADS: tl.constexpr,
    ):
        """_gather_kernel's copies from PROGRAMS programs, each looping over (pick, chunk) items: a gather
        beside compute must leave it most multiprocessors (a program waiting on the link holds one). AT: ids
        are word offsets from src (anywhere in the unified address space: a device cache's rows too, maybe below
        src); QUADS: each a multiple of 4 words, so the loads are 16 bytes a thread, not 4 (Triton cannot see
        that of an offset it loads). An UNREAD id's row is not written."""
        for start in range(0, n_items, PROGRAMS):
            item = start + tl.program_id(0)
            r = item // chunks
            w = (item % chunks) * WORDS + tl.arange(0, WORDS)
            row = tl.load(ids + r, mask=item < n_items, other=_UNREAD).to(tl.int64)
            ok = (w < row_words) & (row != _UNREAD)  # a row nobody reads (a repeated guess)
            at = row if AT else row * row_words
            if QUADS:
                at = tl.multiple_of(at, 4)
            tl.store(dst + r.to(tl.int64) * row_words + w, tl.load(src + at + w, mask=ok), mask=ok)

    @triton.jit
    def _held_offsets_kernel(
        guess, n_live, slot_of, offs, counts, n_guess, w0, w1, w2, d0, d1, d2, expert_bytes, GUESS: tl.constexpr
    ):
        """For each guessed expert and stack s (words a row w_s): where the gather reads it, as a word offset
        from that stack's host base: its row of the device cache (d_s words away) when slot_of holds it, else
        its host row; UNREAD past the first n_live (repeats); and the bytes the guess reads over the link,
        added to counts' GUESS_BYTES."""
        g = tl.arange(0, GUESS)
        inside = g < n_guess
        live = inside & (g < tl.load(n_live))
        e = tl.load(guess + g, mask=live, other=0)
        at = tl.load(slot_of + e, mask=live, other=-1)
        hot = at >= 0
        tl.store(offs + g, tl.where(live, tl.where(hot, d0 + at * w0, e * w0), _UNREAD), mask=inside)
        tl.store(offs + n_guess + g, tl.where(live, tl.where(hot, d1 + at * w1, e * w1), _UNREAD), mask=inside)
        tl.store(offs + 2 * n_guess + g, tl.where(live, tl.where(hot, d2 + at * w2, e * w2), _UNREAD), mask=inside)
        tl.atomic_add(counts + _GUESS_BYTES, tl.sum((live & (at < 0)).to(tl.int64), axis=0) * expert_bytes)

    @triton.jit
    def _copy_rows_kernel(src, src_rows, dst, dst_rows, row_words, WORDS: tl.constexpr):
        """Row src_rows[j] of src into row dst_rows[j] of dst, nothing where that is negative (copy_rows)."""
        j = tl.program_id(0)
        to = tl.load(dst_rows + j).to(tl.int64)
        w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        ok = (w < row_words) & (to >= 0)
        at = tl.load(src_rows + j).to(tl.int64) * row_words
        tl.store(dst + to * row_words + w, tl.load(src + at + w, mask=ok), mask=ok)

    @triton.jit
    def _misses_kernel(
        src,
        ids,
        first,
        guess,
        n_live,
        dst,
        mats,
        counts,
        cache,
        slot_of,
        freq,
        row_words,
        n_guess,
        GUESS: tl.constexpr,
        WORDS: tl.constexpr,
        COUNTING: tl.constexpr,
        CACHED: tl.constexpr,
    ):
        """Pick r's row of dst: guess's position j if ids[r] is guess[j] (prefetched there; only the first
        n_live are), else n_guess + first[r], read here (by the expert's first pick alone) from host memory, or
        from the device stack cache when CACHED and slot_of names a row of it. The first stack's launch writes
        that row index to mats and counts picks and misses (and with CACHED, picks the cache holds, and each
        expert's picks in freq) on the device; each launch adds the bytes its own stack read over the link."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(ids + r)
        lead = tl.load(first + r)
        g = tl.arange(0, GUESS)
        live = (g < n_guess) & (g < tl.load(n_live))
        hit = (tl.load(guess + g, mask=live, other=-1) == row).to(tl.int32)
        found = tl.max(hit, axis=0)
        reads = (found == 0) & (lead == r)  # a miss, the first pick of its expert
        if CACHED:
            at = tl.load(slot_of + row)
        else:
            at = tl.full((), -1, tl.int64)
        if c == 0:
            if COUNTING:
                tl.store(mats + r, tl.where(found > 0, tl.argmax(hit, axis=0), n_guess + lead).to(tl.int64))
                tl.atomic_add(counts + _PICKS, 1)
                tl.atomic_add(counts + _MISSES, (1 - found).to(tl.int64))
                if CACHED:
                    tl.atomic_add(counts + _CACHED, (at >= 0).to(tl.int64))
                    tl.atomic_add(freq + row, 1)
            if reads & (at < 0):
                tl.atomic_add(counts + _MISS_BYTES, row_words.to(tl.int64) * 4)
        if reads:
            w = c * WORDS + tl.arange(0, WORDS)
            ok = w < row_words
            if CACHED:
                hot = tl.load(cache + at * row_words + w, mask=ok & (at >= 0))
                v = tl.where(at >= 0, hot, tl.load(src + row.to(tl.int64) * row_words + w, mask=ok & (at < 0)))
            else:
                v = tl.load(src + row.to(tl.int64) * row_words + w, mask=ok)
            tl.store(dst + (n_guess + r).to(tl.int64) * row_words + w, v, mask=ok)


def first_picks(picks: torch.Tensor) -> torch.Tensor:
    """For each pick [n], the index of the first pick of the same expert: a batch's rows often share experts,
    and a gather that reads each once moves fewer bytes. Fixed shape, no host sync (a captured step's too)."""
    same = picks[:, None] == picks[None, :]  # [n, n]
    return same.int().argmax(1)  # the first of the maxima


def union(picks: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of picks [n] in the order first seen, then repeats of them, [width] (width at least as
    many as are distinct, at most n), and how many are distinct ([] on the device): several rows' guesses, each
    expert read once. A fixed shape and no host sync (a captured step's too)."""
    at = torch.arange(picks.numel(), device=picks.device)
    lead = first_picks(picks) == at
    kept = lead.cumsum(0)  # distinct ids up to each pick
    to = torch.where(lead, kept - 1, kept[-1] + at - kept)  # the first picks in order, then the repeats
    return torch.empty_like(picks).scatter_(0, to, picks)[:width], kept[-1]


def available() -> bool:
    """Whether the kernel exists here (Triton present); whether it can read this host memory shows on first use."""
    return triton is not None


class RowGather:
    """Picks rows of stored bytes onto the rows' device: by the kernel, until it fails once; from then on this
    picker goes through the host without trying again (its owner's state: other engines are not affected)."""

    def __init__(self) -> None:
        self.kernel_failed = False  # the kernel could not read host memory here: later calls skip it

    @property
    def kernel_ok(self) -> bool:
        """Whether the kernel may read host memory (Triton present, no failed attempt by this picker)."""
        return available() and not self.kernel_failed

    def __call__(
        self,
        src: torch.Tensor,
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
        programs: int | None = None,
        cache: Cached | None = None,
        first: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """src[rows] on rows' device, into out [n, ...] (contiguous) when given. src [N, ...] holds stored
        bytes (uint8, any device); rows [n] int64. programs: at most this many kernel programs (None: one a
        pick and chunk of it, the fastest alone). cache: rows of src also held on the device, read there.
        first: first_picks(rows): the kernel then reads only the rows where first[r] == r (the others are to be
        indexed through first)."""
        out = torch.empty((rows.numel(), *src.shape[1:]), dtype=src.dtype, device=rows.device) if out is None else out
        if src.device == rows.device:
            return _from_cache(torch.index_select(src, 0, rows, out=out), rows, cache)
        if self.reads(src, rows):
            try:
                with on_device(rows):
                    if programs is None:
                        words = out[0].numel() // 4
                        _gather_kernel[(rows.numel(), triton.cdiv(words, WORDS_PER_PROGRAM))](
                            _words(src),
                            rows,
                            _words(out),
                            words,
                            first if first is not None else rows,  # unread without DEDUP
                            WORDS=WORDS_PER_PROGRAM,
                            DEDUP=first is not None,
                        )
                    else:
                        self._few(src, rows, out, programs, at=False)
                return _from_cache(out, rows, cache)
            except Exception as e:
                self.failed(e)
        return _from_cache(out.copy_(src[rows.cpu()]), rows, cache)  # through the host: a sync on the ids

    def _few(
        self, src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, programs: int, at: bool, quads: bool = False
    ) -> None:
        words, chunk = out[0].numel() // 4, tuning.current().gather_words
        chunks = triton.cdiv(words, chunk)
        _gather_few_kernel[(programs,)](
            _words(src), rows, _words(out), words, rows.numel() * chunks, chunks, chunk, programs, at, quads
        )

    def gather_held(
        self,
        srcs: list[torch.Tensor],
        ids: torch.Tensor,
        n_live: torch.Tensor,
        outs: list[torch.Tensor],
        stacks: list[torch.Tensor],
        slot_of: torch.Tensor,
        counts: torch.Tensor,
        offs: torch.Tensor,
        programs: int,
    ) -> None:
        """Each host stack's rows ids [G] into outs on PROGRAMS programs, those slot_of [n_expert] names read
        from the device stacks instead (offs [3, G]: where each is read); only the first n_live ([] on the
        device) are read, the rest (repeats, union's) left unwritten; counts (slots of Count) gains the bytes read
        over the link as GUESS_BYTES. Raises if the kernels fail (the caller then picks another way)."""
        G = ids.numel()
        words = [out[0].numel() // 4 for out in outs]
        deltas = []
        for src, stack in zip(srcs, stacks, strict=True):
            gap = stack.data_ptr() - src.data_ptr()  # one address space: the device rows seen from the host base
            deltas.append(gap // 4)
        with on_device(ids):
            _held_offsets_kernel[(1,)](
                ids,
                n_live,
                slot_of,
                offs,
                counts,
                G,
                *words,
                *deltas,
                4 * sum(words),
                GUESS=triton.next_power_of_2(G),
            )
            quads = all(n % 4 == 0 for n in [*words, *deltas])  # every offset a multiple of 4 words (16 bytes)
            for s, (src, out) in enumerate(zip(srcs, outs, strict=True)):
                self._few(src, offs[s], out, programs, at=True, quads=quads)

    def failed(self, e: Exception) -> None:
        """A kernel reading host memory failed: say it once; this picker goes through the host from now on."""
        self.kernel_failed = True
        warnings.warn(f"reading host memory from the GPU failed ({e}); experts are picked on the host", stacklevel=3)

    def reads(self, src: torch.Tensor, rows: torch.Tensor) -> bool:
        """Whether the kernel picks rows of host tensor src onto rows' GPU (whole 32-bit words, in place)."""
        ok = self.kernel_ok and rows.is_cuda and not src.is_cuda and src.dtype == torch.uint8 and src.is_contiguous()
        return ok and (src[0].numel() % 4 == 0 and src.data_ptr() % 4 == 0)


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows[j]] = src[src_rows[j]] for each j with dst_rows[j] >= 0, both stacks [N, ...] of stored bytes on
    one device: on a GPU (or Triton's interpreter) one launch that reads the rows it writes only (no host sync);
    elsewhere through indexing."""
    if (dst.is_cuda or INTERPRETED) and triton is not None:
        words = dst[0].numel() // 4
        with on_device(dst):
            _copy_rows_kernel[(dst_rows.numel(), triton.cdiv(words, WORDS_PER_PROGRAM))](
                _words(src), src_rows, _words(dst), dst_rows, words, WORDS=WORDS_PER_PROGRAM
            )
        return
    wanted = (dst_rows >= 0).nonzero().view(-1)
    dst[dst_rows[wanted]] = src[src_rows[wanted]]


def fill_misses(
    src: torch.Tensor,
    ids: torch.Tensor,
    first: torch.Tensor,
    guess: torch.Tensor,
    n_live: torch.Tensor,
    dst: torch.Tensor,
    mats: torch.Tensor,
    counts: torch.Tensor,
    counting: bool,
    cache: Cached | None = None,
    freq: torch.Tensor | None = None,
) -> None:
    """The picks ids [n] of host stack src that guess [G] missed (its first n_live, [] on the device, were
    gathered), read into dst rows G.. (dst [G + n, ...] holds the guessed experts in rows 0..G-1), each missed
    expert once (first: first_picks(ids); the row of its first pick), from cache where it holds them; mats [n]
    gets each pick's row of dst, and counts (slots of Count) gains PICKS, MISSES and CACHED and freq [n_expert]
    (with a cache) from the first stack's launch (counting), MISS_BYTES from each. No host sync: ids stay on
    the device."""
    words = src[0].numel() // 4
    G = guess.numel()
    stack, slot_of = cache if cache is not None else (dst, ids)  # unread without a cache
    with on_device(ids):
        _misses_kernel[(ids.numel(), triton.cdiv(words, WORDS_PER_PROGRAM))](
            _words(src),
            ids,
            first,
            guess,
            n_live,
            _words(dst),
            mats,
            counts,
            _words(stack),
            slot_of,
            freq if freq is not None else counts,
            words,
            G,
            GUESS=triton.next_power_of_2(G),
            WORDS=WORDS_PER_PROGRAM,
            COUNTING=counting,
            CACHED=cache is not None,
        )


def _from_cache(out: torch.Tensor, rows: torch.Tensor, cache: Cached | None) -> torch.Tensor:
    """out [n, ...], src's rows: those the cache holds rewritten from it (the same bytes; read there so that a
    wrong cache shows as a wrong answer wherever the kernel is not used)."""
    if cache is not None:
        stack, slot_of = cache
        at = slot_of[rows]
        hot = (at >= 0).nonzero().view(-1)  # a host sync: only off the kernel's path
        out[hot] = stack[at[hot]]
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous byte stack [N, ...] as [N, bytes / 4] int32: the same memory (a stored row, say Q6_K's 630
    bytes, need not be a multiple of 4; an expert of them is)."""
    return t.reshape(t.shape[0], -1).view(torch.int32)
