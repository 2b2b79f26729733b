"""Compile the decode kernels for the H200 (sm_90) on a machine without a GPU, with the ptxas that
ships in Triton's wheel: a compile error shows here, not in the first minutes of device time. Needs triton
(`pip install triton==3.6.0`); prints each kernel's static SASS instruction count and global loads,
registers a thread (they cap the occupancy of the decode launches) and int-to-float conversions, for the
current tuning (kernels/tuning.py).

    python scripts/compile_sm90.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moestream.formats import quants
from moestream.kernels import decode_attention, deltanet_step, dots, fused, kv_quant, moe_matvec, tuning
from moestream.kernels import matvec as mv

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def build(label: str, fn, signature: dict, constexprs: dict, warps: int = 4, divisible: tuple = ()) -> None:
    """divisible: integer arguments whose values are multiples of 16 in the model's launches, which Triton
    specializes on (it then proves the word loads' alignment and vectorizes them)."""
    start = time.time()
    attrs = _aligned(fn, signature) | {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    pdl = "PDL" in fn.arg_names  # the decode step's kernels, with programmatic dependent launch (tuning's pdl)
    k = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs | ({"PDL": True} if pdl else {}), attrs=attrs),
        target=TARGET,
        options={"num_warps": warps, "launch_pdl": pdl},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))  # registers a thread: they cap the warps an SM holds
    n = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))
    i2f = len(re.findall(r"\bI2F", sass))  # int to float: 16 a clock on an SM, an eighth of FFMA's rate
    spills = len(re.findall(r"\b(?:LDL|STL)", sass))  # registers spilled to local memory
    loads = len(re.findall(r"\bLDG", sass))  # global loads (weights, x, and lookup tables through L1)
    print(
        f"{label:<40} compiled in {time.time() - start:4.1f} s, {n} SASS instructions, {regs} registers, {i2f} I2F, "
        f"{spills} spills, {loads} LDG",
        flush=True,
    )


def _aligned(fn, signature: dict) -> dict:
    """Every pointer 16-byte aligned, as Triton specializes a launch on a fresh torch tensor (without it the
    loads compile scalar and the counts mislead)."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, t in signature.items() if t[0] == "*"}


def main() -> None:
    t = tuning.current()
    matvec = {"w": "*u8", "x": "*bf16", "y": "*bf16", "mats": "*i64", "n_out": "i32", "row_bytes": "i32"}
    matvec |= {"table": "*i32"}  # a grid type's lookup table (unread by the others)
    rows = [(Q.Q4_K, 8, False), (Q.Q4_K, 16, False), (Q.Q5_K, 8, False), (Q.Q6_K, 8, False), (Q.Q6_K, 3, True)]
    rows += [(q, 2048 // GGML_QUANT_SIZES[q][0], False) for q in dots.DOTS if q not in (Q.Q4_K, Q.Q5_K, Q.Q6_K)]
    rows += [(Q.MXFP4, 90, True)]  # gpt-oss's experts: rows of 2880, 2-byte aligned
    for qtype, n_blocks, stacked in rows:
        elems, size = GGML_QUANT_SIZES[qtype]
        nothing = torch.empty(0, dtype=torch.uint8)  # layout checks alignment only
        _, consts = mv.layout(qtype, n_blocks * elems, nothing, t.blocks_at_once, t.float_blocks_at_once)
        consts |= dict(STACKED=stacked, ROWS=t.rows_per_program, UNROLLED=t.unrolled)
        consts |= dict(TABLE=quants.get(qtype).table is not None)
        div = ("n_out", "row_bytes") if n_blocks * size % 16 == 0 else ("n_out",)
        build(f"matvec {qtype.name}, {n_blocks} blocks a row", mv._matvec_kernel, dict(matvec), consts, divisible=div)
    for dtype, qtype in dots.FLOAT_QTYPES.items():  # the router's product, 2048 wide
        consts = dict(
            N_BLOCKS=2048 // dots.FLOAT_BLOCK,
            DOT=dots.FLOAT_DOTS[qtype],
            TABLE=False,
            ELEMS=dots.FLOAT_BLOCK,
            SIZE=dots.FLOAT_BLOCK * dtype.itemsize,
            STACKED=False,
            ROWS=1,
            B=mv.blocks_at_once(2048 // dots.FLOAT_BLOCK, t.float_blocks_at_once),
            UNROLLED=t.unrolled,
        )
        div = ("n_out", "row_bytes")
        build(f"matvec {qtype.name} (float weight)", mv._matvec_kernel, dict(matvec), consts, warps=1, divisible=div)
    parts = {"x": "*bf16"}
    for i in range(4):
        parts |= {f"w{i}": "*u8", f"y{i}": "*bf16", f"n{i}": "i32", f"rb{i}": "i32"}
    parts |= {f"end{i}": "i32" for i in range(3)} | {f"t{i}": "*i32" for i in range(4)}
    qkv = [(Q.Q4_K, 8, 256, 144), (Q.Q4_K, 8, 256, 144), (Q.Q6_K, 8, 256, 210), (Q.Q6_K, 8, 256, 210)]
    consts = dict(D=2048, PARTS=3, ROWS=t.rows_per_program, UNROLLED=t.unrolled)
    for i, (qtype, n_blocks, elems, size) in enumerate(qkv):
        consts |= {
            f"N{i}": n_blocks,
            f"DOT{i}": dots.DOTS[qtype],
            f"T{i}": False,
            f"E{i}": elems,
            f"S{i}": size,
            f"B{i}": mv.blocks_at_once(n_blocks, t.blocks_at_once),
        }
    div = tuple(f"{a}{i}" for i in range(4) for a in ("n", "rb")) + ("end0", "end1", "end2")
    build("matvecs q+k+v (Q4_K, Q4_K, Q6_K)", mv._matvecs_kernel, parts, consts, divisible=div)
    gate_up = {
        "wg": "*u8",
        "wu": "*u8",
        "x": "*bf16",
        "h": "*bf16",
        "mats": "*i64",
        "n_out": "i32",
        "row_bytes": "i32",
        "K": "i32",
        "table": "*i32",
    }
    consts = dict(
        N_BLOCKS=8,
        DOT=dots.DOTS[Q.Q4_K],
        TABLE=False,
        ELEMS=256,
        SIZE=144,
        ROWS=t.rows_per_program,
        B=mv.blocks_at_once(8, t.gate_up_blocks_at_once),
        UNROLLED=t.unrolled,
    )
    for stacked in (True, False):  # the routed experts' pairs; a shared expert's dense pair
        label = "gate+up Q4_K" + ("" if stacked else ", dense")
        consts |= {"STACKED": stacked}
        build(label, moe_matvec._gate_up_kernel, gate_up, consts, divisible=("n_out", "row_bytes"))
    for shared in (False, True):
        build(
            "weighted sum + residual" + (" + shared expert" if shared else "") + ", 8 experts",
            moe_matvec._weighted_sum_kernel,
            dict.fromkeys(("down", "w", "res", "shared", "gate", "out"), "*bf16") | {"D": "i32"},
            dict(K=8, BLOCK=t.sum_block, RESIDUAL=True, SHARED=shared),
        )

    names = ("q", "k", "v", "wq", "wk", "bq", "bk", "bv", "q_out", "k_cache", "v_cache", "cos", "sin")
    prologue = dict.fromkeys(names, "*bf16")
    build(
        "q/k norm + RoPE + KV store, Dh 128",
        fused._qkv_store_kernel,
        prologue | {"positions": "*i64", "H": "i32", "HKV": "i32", "eps": "fp32"},
        dict(D=128, BLOCK=128, HALF=64, NORM=True, BIAS=False),
    )

    build(
        "router softmax + top-8 of 128, one warp",
        fused._softmax_topk_kernel,
        {"logits": "*fp32", "w_out": "*bf16", "id_out": "*i64", "E": "i32"},
        dict(K=8, KP=8, BLOCK_E=128, RENORM=True),
        warps=1,
    )

    build(
        "residual add + RMSNorm, D 2048",
        fused._add_rms_norm_kernel,
        dict.fromkeys(("x", "r", "w", "h", "y"), "*bf16") | {"eps": "fp32"},
        dict(D=2048, BLOCK=2048),
        warps=8,
    )

    attention = dict.fromkeys(("q", "k", "v", "sinks"), "*bf16") | {"positions": "*i64"}
    attention |= dict.fromkeys(("part", "maxes", "sums"), "*fp32") | {
        "out": "*bf16",
        "n_keys": "i32",
        "window": "i32",
        "qk_scale": "fp32",
    }
    attention |= dict.fromkeys(("sqt", "sqh", "sqd", "sks", "skh", "skd", "svs", "svh", "svd"), "i32")
    for n_chunks in (1, 16):  # a short bucket normalises in the chunk kernel; a long one is combined after
        consts = dict(HKV=4, G=8, G_PAD=16, DH=128, CHUNK=256, N_CHUNKS=n_chunks, BLOCK_S=64, PRECISION="tf32")
        consts |= dict(SINKS=False, KIND_K=0, KIND_V=0)
        for warps in sorted({t.attention_chunk_warps, t.attention_spread_warps}):
            label = f"decode attention, {n_chunks} chunk(s) of 256 keys, {warps} warps"
            build(label, decode_attention._chunk_kernel, attention, consts, warps=warps)
    for kind_k, kind_v in ((1, 1), (2, 2)):  # -ctk/-ctv q8_0 and q4_0: tiles dequantized from the blocks
        blocks = attention | dict.fromkeys(("k", "v"), "*u8")
        consts = dict(HKV=4, G=8, G_PAD=16, DH=128, CHUNK=256, N_CHUNKS=16, BLOCK_S=64, PRECISION="tf32", SINKS=False)
        label = f"decode attention, KV {('q8_0', 'q4_0')[kind_k - 1]}, 16 chunks"
        build(label, decode_attention._chunk_kernel, blocks, consts | dict(KIND_K=kind_k, KIND_V=kind_v))
    for kind, size in ((1, 34), (2, 18)):
        build(
            f"KV row quantize, {('q8_0', 'q4_0')[kind - 1]}",
            kv_quant._quantize_kernel,
            {"x": "*bf16", "out": "*u8", "n_blocks": "i32"},
            dict(KIND=kind, BYTES=size, BLOCKS=16),
        )
    build(
        "decode attention combine, 16 chunks",
        decode_attention._combine_kernel,
        dict.fromkeys(("part", "maxes", "sums"), "*fp32") | {"out": "*bf16", "sinks": "*bf16"},
        dict(H=32, DH=128, N_CHUNKS=16, BLOCK_C=t.attention_combine_block, SINKS=False),
    )

    rule = dict.fromkeys(("y", "alpha", "beta", "z", "dt_bias", "ssm_a", "norm", "state", "out"), "*fp32")
    build(
        "delta rule, one head's 128 x 128 state in one tile",
        deltanet_step._rule_kernel,
        rule
        | {
            "out": "*bf16",
            "z": "*bf16",
            "alpha": "*bf16",
            "beta": "*bf16",
            "eps": "fp32",
            "scale": "fp32",
            "Hk": "i32",
        },
        dict(Dk=128, Dv=128, BK=128, BV=128),
        warps=deltanet_step._warps(128, 128),
    )


if __name__ == "__main__":
    main()
