"""Quantized matrix-vector products for a few tokens (decode): y = W x straight from the stored blocks.

Dequantizing a weight to bf16 and then multiplying writes and reads it twice more than it is stored; for a
token or two that traffic, plus the extra launches, is the whole cost. These kernels read each block once,
unpack it in registers (kernels/dots.py, one dot a tensor type) and accumulate in float32. The blocks may lie
in device memory or in page-locked host memory, which the kernel then reads over the link itself, like
kernels/gather.py. A stack of matrices (experts) is indexed per row of x, with the indices on the device.
Float weights (the router) go through the same kernel, their values read in blocks of dots.FLOAT_BLOCK.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from moestream.kernels import tuning
from moestream.kernels.dequant import table_args
from moestream.kernels.dots import DOTS, FLOAT_BLOCK, FLOAT_DOTS, FLOAT_QTYPES, WORD_BYTES
from moestream.kernels.launch import multiprocessors, on_device, pdl, triton

if triton is not None:
    import triton.language as tl

    from moestream.kernels.dots import block_dot
    from moestream.kernels.launch import pdl_start

    @triton.jit
    def row_dot(
        w, w2, mat, out, n_out, row_bytes, xp, ok, table, N_BLOCKS: tl.constexpr, DOT: tl.constexpr,
        TABLE: tl.constexpr, ELEMS, SIZE, B: tl.constexpr, UNROLLED: tl.constexpr, PAIR: tl.constexpr,
    ):  # fmt: skip
        """[R] dot products of rows `out` of matrix `mat` of the stack w with the vector at xp, B blocks a row
        at a time (B <= N_BLOCKS), and with PAIR the same rows of the stack w2 (stored alike) beside them.
        A row of up to UNROLLED blocks is unrolled, so the loads of every turn can go out before the first
        one's products, at the price of registers. The sums keep their order either way. The last turn of a
        row whose blocks B does not divide (gpt-oss's 2880 values: 90 blocks of 32) reads its blocks masked:
        all-zero bytes decode to zeros in every type, times x of the row's last block. table: the type's
        lookup table, if it has one (TABLE)."""
        at = (mat * n_out + out[:, None, None].to(tl.int64)) * row_bytes
        blk = tl.arange(0, B)[None, :, None]
        ok = ok[:, :, None]
        a = block_dot(DOT, w + at + blk * SIZE, xp + blk * ELEMS, ok, table, TABLE)
        b = block_dot(DOT, w2 + at + blk * SIZE, xp + blk * ELEMS, ok, table, TABLE) if PAIR else a
        for j in tl.range(
            1, N_BLOCKS // B, loop_unroll_factor=max(1, N_BLOCKS // B - 1) if N_BLOCKS <= UNROLLED else 1
        ):
            a += block_dot(DOT, w + at + (j * B + blk) * SIZE, xp + (j * B + blk) * ELEMS, ok, table, TABLE)
            if PAIR:
                b += block_dot(DOT, w2 + at + (j * B + blk) * SIZE, xp + (j * B + blk) * ELEMS, ok, table, TABLE)
        if N_BLOCKS % B:
            idx = (N_BLOCKS // B) * B + blk
            tail = ok & (idx < N_BLOCKS)
            idx = tl.minimum(idx, N_BLOCKS - 1)
            a += block_dot(DOT, w + at + idx * SIZE, xp + idx * ELEMS, tail, table, TABLE)
            if PAIR:
                b += block_dot(DOT, w2 + at + idx * SIZE, xp + idx * ELEMS, tail, table, TABLE)
        return _total(a), _total(b)

    @triton.jit
    def _total(a):
        """The sum of a dot's partial products [R, B, ...] for each of the R rows."""
        if len(a.shape) == 4:
            a = tl.sum(a, axis=3)
        return tl.sum(tl.sum(a, axis=2), axis=1)

    @triton.jit
    def _matvec_kernel(
        w,
        x,
        y,
        mats,
        n_out,
        row_bytes,
        table,
        N_BLOCKS: tl.constexpr,  # blocks per row (a handful of sizes per model)
        DOT: tl.constexpr,
        TABLE: tl.constexpr,
        ELEMS: tl.constexpr,
        SIZE: tl.constexpr,
        STACKED: tl.constexpr,
        ROWS: tl.constexpr,
        B: tl.constexpr,
        UNROLLED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        p = tl.program_id(1).to(tl.int64)  # which row of x (a token, or a token-expert pair)
        mat = tl.load(mats + p).to(tl.int64) if STACKED else 0
        _part(
            w,
            mat,
            x + p * N_BLOCKS * ELEMS,
            y,
            p,
            tl.program_id(0),
            n_out,
            row_bytes,
            table,
            N_BLOCKS,
            DOT,
            TABLE,
            ELEMS,
            SIZE,
            ROWS,
            B,
            UNROLLED,
        )

    @triton.jit(noinline=True)
    def _part(
        w, mat, xp, y, p, block, n_out, row_bytes, table, N_BLOCKS, DOT, TABLE, ELEMS, SIZE, ROWS: tl.constexpr, B,
        UNROLLED,
    ):  # fmt: skip
        """Rows block * ROWS.. of matrix mat of the stack w (one matrix of matvecs' launch: mat 0), for row p
        of x. Not inlined: Triton's coalescing pass grows with the square of a function's size, so a fused
        projection's unrolled parts compile several times faster as calls (the same loads and load widths)."""
        out = block * ROWS + tl.arange(0, ROWS)
        ok = (out < n_out)[:, None]
        dot, _ = row_dot(
            w, w, mat, out, n_out, row_bytes, xp, ok, table, N_BLOCKS, DOT, TABLE, ELEMS, SIZE, B, UNROLLED, False
        )
        tl.store(y + p * n_out + out, dot.to(y.dtype.element_ty), mask=out < n_out)

    @triton.jit
    def _matvecs_kernel(
        x,
        w0,
        y0,
        n0,
        rb0,
        w1,
        y1,
        n1,
        rb1,
        w2,
        y2,
        n2,
        rb2,
        w3,
        y3,
        n3,
        rb3,
        end0,
        end1,
        end2,
        t0,
        t1,
        t2,
        t3,
        D: tl.constexpr,
        PARTS: tl.constexpr,
        ROWS: tl.constexpr,
        N0: tl.constexpr,
        DOT0: tl.constexpr,
        T0: tl.constexpr,
        E0: tl.constexpr,
        S0: tl.constexpr,
        B0: tl.constexpr,
        N1: tl.constexpr,
        DOT1: tl.constexpr,
        T1: tl.constexpr,
        E1: tl.constexpr,
        S1: tl.constexpr,
        B1: tl.constexpr,
        N2: tl.constexpr,
        DOT2: tl.constexpr,
        T2: tl.constexpr,
        E2: tl.constexpr,
        S2: tl.constexpr,
        B2: tl.constexpr,
        N3: tl.constexpr,
        DOT3: tl.constexpr,
        T3: tl.constexpr,
        E3: tl.constexpr,
        S3: tl.constexpr,
        B3: tl.constexpr,
        UNROLLED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Up to four matrices times the same row of x, one launch: program blocks 0..end0 belong to the first,
        end0..end1 to the second, and so on."""
        pdl_start(PDL)
        p = tl.program_id(1).to(tl.int64)
        blk = tl.program_id(0)
        xp = x + p * D
        if blk < end0:
            _part(w0, 0, xp, y0, p, blk, n0, rb0, t0, N0, DOT0, T0, E0, S0, ROWS, B0, UNROLLED)
        elif blk < end1:
            _part(w1, 0, xp, y1, p, blk - end0, n1, rb1, t1, N1, DOT1, T1, E1, S1, ROWS, B1, UNROLLED)
        elif PARTS > 2:
            if blk < end2:
                _part(w2, 0, xp, y2, p, blk - end1, n2, rb2, t2, N2, DOT2, T2, E2, S2, ROWS, B2, UNROLLED)
            elif PARTS > 3:
                _part(w3, 0, xp, y3, p, blk - end2, n3, rb3, t3, N3, DOT3, T3, E3, S3, ROWS, B3, UNROLLED)


def linear_each_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) of a float w, each row on its own for a few rows (up to the tuning's max_tokens): on a GPU
    through matvec (one launch, tiles chosen per row), elsewhere row by row, since cuBLAS picks its kernel, and
    so its rounding, by the row count, and a server's batched decode step must give each sequence the bits of
    its step alone. Larger batches (prefill) multiply at once."""
    if reads_float(x, w):
        return matvec(*float_part(w), x)
    if 1 < x.shape[0] <= tuning.current().max_tokens:
        return torch.cat([F.linear(row, w) for row in x.split(1)])
    return F.linear(x, w)


def float_part(w: torch.Tensor) -> tuple[torch.Tensor, GGMLQuantizationType, int]:
    """A float weight [out, in] as matvec's (raw bytes, type, rows): its rows read as FLOAT_BLOCK-value blocks."""
    return w.view(torch.uint8), FLOAT_QTYPES[w.dtype], w.shape[0]


def reads_float(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether matvec's float dots serve x [T, in] times the float weight w [out, in]."""
    return (
        0 < x.shape[0] <= tuning.current().max_tokens
        and x.is_cuda
        and x.dtype == w.dtype
        and FLOAT_QTYPES.get(w.dtype) in FLOAT_DOTS
        and x.shape[-1] % FLOAT_BLOCK == 0
        and w.dim() == 2
        and w.shape[1] == x.shape[-1]
        and w.is_contiguous()
    )


def usable(qtype: GGMLQuantizationType, device: torch.device, n_tokens: int) -> bool:
    """Whether matvec serves n_tokens rows on device against a weight of this type."""
    return qtype in DOTS and device.type == "cuda" and n_tokens <= tuning.current().max_tokens


def matvec(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    n_out: int,
    x: torch.Tensor,
    mats: torch.Tensor | None = None,
    rows_per_token: int = 1,
) -> torch.Tensor:
    """y [P, n_out] = W_p x[p] for each row p of x [P, in], in x's dtype.

    raw holds the stored bytes of one matrix [n_out, in] (mats None) or of a stack [E, n_out, in], in which
    case mats [P] (int64, on x's device) says which matrix each row of x multiplies. raw may be a CUDA tensor
    or page-locked host memory that the GPU can address. The tile is chosen for one token's rows_per_token
    rows of x, not for all P: the tile orders the sums, and a token's bits must not depend on how many other
    tokens share the launch (a server's batched decode gives each sequence the tokens of its step alone)."""
    t = tuning.current()
    row_bytes, consts = layout(qtype, x.shape[-1], raw, t.blocks_at_once, t.float_blocks_at_once)
    x = aligned_x(x)
    y = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    rows, warps = tile(t.rows_per_program, t.warps, n_out, rows_per_token, fewest_programs(x.device, t))
    grid = (triton.cdiv(n_out, rows), x.shape[0])
    with on_device(x):
        _matvec_kernel[grid](
            raw,
            x,
            y,
            mats if mats is not None else x,  # unread when not stacked
            n_out,
            row_bytes,
            **table_args(qtype, x),
            STACKED=mats is not None,
            ROWS=rows,
            UNROLLED=t.unrolled,
            num_warps=warps,
            **consts,
            **pdl(x),
        )
    return y


def matvecs(parts: list[tuple[torch.Tensor, GGMLQuantizationType, int]], x: torch.Tensor) -> list[torch.Tensor]:
    """[matvec(raw, qtype, n_out, x) for each part] in one launch, for 2 to 4 matrices that multiply the same
    x [P, in] (a layer's q, k and v): one launch instead of several, and the small ones share a full grid.
    The tile is chosen from the parts' rows together, for one row of x (see matvec)."""
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"matvecs takes 2 to 4 matrices, not {len(parts)}")
    t = tuning.current()
    x = aligned_x(x)
    rows, warps = tile(t.rows_per_program, t.warps, sum(n for _, _, n in parts), 1, fewest_programs(x.device, t))
    args, tables, consts, ys, ends = [], [], {}, [], [0]
    for i, (raw, qtype, n_out) in enumerate(parts + parts[-1:] * (4 - len(parts))):  # unused slots: never read
        row_bytes, c = layout(qtype, x.shape[-1], raw, t.blocks_at_once, t.float_blocks_at_once)
        if i < len(parts):
            ys.append(torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device))
            ends.append(ends[-1] + triton.cdiv(n_out, rows))  # the part's program blocks end here
        args += [raw, ys[-1], n_out, row_bytes]
        table = table_args(qtype, x)
        tables.append(table["table"])
        consts |= {
            f"T{i}": table["TABLE"],
            f"N{i}": c["N_BLOCKS"],
            f"DOT{i}": c["DOT"],
            f"E{i}": c["ELEMS"],
            f"S{i}": c["SIZE"],
            f"B{i}": c["B"],
        }
    ends += ends[-1:] * (4 - len(parts))
    with on_device(x):
        _matvecs_kernel[(ends[-1], x.shape[0])](
            x,
            *args,
            *ends[1:4],
            *tables,
            D=x.shape[-1],
            PARTS=len(parts),
            ROWS=rows,
            UNROLLED=t.unrolled,
            num_warps=warps,
            **consts,
            **pdl(x),
        )
    return ys


def aligned_x(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned: the K-quant dots load a bfloat16 x 4 or 2 values at a time, which a
    view starting inside a word would fault on (the engine's own tensors are aligned already)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def check_aligned(qtype: GGMLQuantizationType, raw: torch.Tensor) -> None:
    """Every buffer the engine hands in is its own allocation or a map of 32-byte aligned tensor data, so the
    K-quant dots' word loads are aligned; a view that is not would read wrong words, hence the check."""
    align = WORD_BYTES.get(qtype, 1)
    if raw.data_ptr() % align:
        raise ValueError(f"{qtype.name} blocks must start {align}-byte aligned for the quantized matvec (pass a copy)")


def layout(
    qtype: GGMLQuantizationType, n_in: int, raw: torch.Tensor, at_most: int, float_at_most: int
) -> tuple[int, dict]:
    """The bytes a stored row of n_in elements takes, and the kernels' compile-time constants for it: up to
    at_most blocks a tile (8 times that for blocks of 32 values; float_at_most for a float weight)."""
    check_aligned(qtype, raw)
    if qtype in FLOAT_DOTS:  # a float weight, read in blocks of FLOAT_BLOCK values
        block, type_size, at_most = FLOAT_BLOCK, FLOAT_BLOCK * GGML_QUANT_SIZES[qtype][1], float_at_most
    else:  # blocks of 32 values come several at a time: at_most counts super-blocks' worth of them
        block, type_size = GGML_QUANT_SIZES[qtype]
        at_most *= max(1, QK_K // block)
    dot = DOTS[qtype] if qtype in DOTS else FLOAT_DOTS[qtype]
    if n_in % block:
        raise ValueError(f"{qtype.name} rows of {n_in} values are not whole blocks of {block}")
    n_blocks = n_in // block
    return n_blocks * type_size, dict(
        N_BLOCKS=n_blocks, DOT=dot, ELEMS=block, SIZE=type_size, B=blocks_at_once(n_blocks, at_most)
    )


def blocks_at_once(n_blocks: int, at_most: int) -> int:
    """Blocks of a row loaded together: the largest power of two up to at_most and n_blocks (row_dot masks
    the last turn's blocks past the row's end)."""
    at_once = 1
    while 2 * at_once <= min(at_most, n_blocks):
        at_once *= 2
    return at_once


def fewest_programs(device: torch.device, t: tuning.Tuning) -> int:
    """t.programs_per_sm programs for each multiprocessor of device (0 for the CPU, where Triton interprets)."""
    return multiprocessors(device) * t.programs_per_sm


def tile(rows: int, warps: int, n_out: int, n_vectors: int, min_programs: int) -> tuple[int, int]:
    """Output rows and warps a program: fewer of both while the grid would have under min_programs programs
    (a small matrix, such as a 512-row k projection, then still spreads over the GPU). Each pair is its own
    compiled kernel: a few per weight shape."""
    while rows > 1 and -(-n_out // rows) * n_vectors < min_programs:
        rows //= 2
        warps = max(1, warps // 2)
    return rows, warps
