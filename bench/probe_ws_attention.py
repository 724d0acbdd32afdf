"""Warp specialisation probe for the MLA tile (issue #6, goal 2): Triton's automatic warp specialisation
(`tl.range(..., warp_specialize=True)`) of the unmasked attention loop, on sm_90, beside the same loop without it.

Triton 3.6 specialises the loop only when every tensor load and store of the kernel goes through a tensor
descriptor (TMA); one pointer-based tensor load anywhere (the query, a masked tail loop) fails its pass with
"unsupported load type for producer commit" (3.9's text; 3.6 asserts in WSLowerToken.cpp). So this probe is the
unmasked loop alone, all through descriptors: P programs, each the same BLOCK_M query rows over its own
L_SPLIT entries of a [P * L_SPLIT, 576] cache, writing its normalised [BLOCK_M, 512] output (no mask, no merge),
timed per 64-entry tile beside the kernel's own 64-row config at the same shape (results: the attention section of
triton_kernels/README.md). Usage (device):
`python bench/probe_ws_attention.py --out DIR`; on the CPU `--compile` reports sm_90 resources only.
"""

import argparse
import json
import re
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from triton_kernels.mla_attention import _probs

SCALE_LOG2 = 0.1446802 * 1.4426950408889634
PROBES = [  # (BLOCK_M, BLOCK_N, warps, stages, warp_specialize, unchain); the specialised one last (a hang costs only it)
    (64, 64, 8, 2, False, False), (64, 64, 8, 2, False, True), (64, 32, 8, 2, False, True), (64, 32, 4, 2, False, False),
    (64, 32, 4, 2, True, False),
]


@triton.jit
def _probe_kernel(q_ptr, kv_ptr, o_ptr, L_SPLIT, sm_scale_log2,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr, UNCHAIN: tl.constexpr):
    pid = tl.program_id(0)
    qd = tl.make_tensor_descriptor(q_ptr, shape=[BLOCK_M, 576], strides=[576, 1], block_shape=[BLOCK_M, 256])
    qd_pe = tl.make_tensor_descriptor(q_ptr + 512, shape=[BLOCK_M, 64], strides=[576, 1], block_shape=[BLOCK_M, 64])
    q_lo = qd.load([0, 0])  # [BM, 256]
    q_hi = qd.load([0, 256])
    q_pe = qd_pe.load([0, 0])  # [BM, 64]
    base = kv_ptr + pid.to(tl.int64) * L_SPLIT * 576
    lat = tl.make_tensor_descriptor(base, shape=[L_SPLIT, 576], strides=[576, 1], block_shape=[BLOCK_N, 256])
    pe = tl.make_tensor_descriptor(base + 512, shape=[L_SPLIT, 64], strides=[576, 1], block_shape=[BLOCK_N, 64])
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_M, 256], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, 256], dtype=tl.float32)
    for j in tl.range(0, L_SPLIT, BLOCK_N, warp_specialize=WS):
        k_lo = lat.load([j, 0])  # [BN, 256]
        k_hi = lat.load([j, 256])
        k_pe = pe.load([j, 0])  # [BN, 64]
        s = tl.dot(q_lo, tl.trans(k_lo))
        s = tl.dot(q_hi, tl.trans(k_hi), s)
        s = tl.dot(q_pe, tl.trans(k_pe), s) * sm_scale_log2  # [BM, BN] log2 domain
        if UNCHAIN:  # the kernel's trick (mla_attention._softmax_step): QK^T not laid out as a chained dot
            if L_SPLIT > 0:
                m_new, l_i, p, alpha = _probs(s, m_i, l_i, k_lo.dtype)
            else:
                m_new, p, alpha = m_i, s.to(k_lo.dtype), m_i
        else:
            m_new, l_i, p, alpha = _probs(s, m_i, l_i, k_lo.dtype)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, k_lo)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, k_hi)
        m_i = m_new
    od = tl.make_tensor_descriptor(o_ptr + pid.to(tl.int64) * BLOCK_M * 512, shape=[BLOCK_M, 512], strides=[512, 1],
                                   block_shape=[BLOCK_M, 256])
    od.store([0, 0], (acc_lo / l_i[:, None]).to(o_ptr.dtype.element_ty))
    od.store([0, 256], (acc_hi / l_i[:, None]).to(o_ptr.dtype.element_ty))


def compile_report(probe):
    """sm_90 resources of one probe, compiled on the CPU: shared bytes, registers, spills, warps, setmaxnreg count."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton_kernels.aot import _ptxas_report

    bm, bn, warps, stages, ws, unchain = probe
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "o_ptr": "*bf16", "L_SPLIT": "i32", "sm_scale_log2": "fp32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "WS": "constexpr", "UNCHAIN": "constexpr"}
    src = ASTSource(fn=_probe_kernel, signature=sig, constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "WS": ws,
                                                               "UNCHAIN": unchain},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as exc:
        return {"probe": probe, "error": str(exc)[-300:]}
    regs, spills = _ptxas_report(c.asm["ptx"], 90)
    return {"probe": probe, "shared": c.metadata.shared, "registers": regs, "spill_bytes": spills,
            "warps": c.metadata.num_warps, "setmaxnreg": len(re.findall("setmaxnreg", c.asm["ptx"]))}


def run(probe, P, l_split, q, kv, out):
    bm, bn, warps, stages, ws, unchain = probe
    _probe_kernel[(P,)](q, kv, out, l_split, SCALE_LOG2, BLOCK_M=bm, BLOCK_N=bn, WS=ws, UNCHAIN=unchain,
                        num_warps=warps, num_stages=stages)


def graph_us(call, calls=10):
    """Median us per call of `calls` calls of `call` captured in one CUDA graph (5 timed replays)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def measure(probe, P=132, l_split=2048):
    """Graph-timed probe (tiles a program, us a tile) and its error against torch on program 0's slice."""
    bm = probe[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(bm, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(P * l_split, 576, device="cuda", generator=gen).bfloat16()
    out = torch.empty(P, bm, 512, dtype=torch.bfloat16, device="cuda")
    run(probe, P, l_split, q, kv, out)
    keys = kv[:l_split].float()
    ref = torch.softmax(q.float() @ keys.T * 0.1446802, -1) @ keys[:, :512]
    err = ((out[0].float() - ref).norm() / ref.norm()).item()
    # descriptors made in the kernel: the allocator's scratch is captured too
    us = graph_us(lambda: run(probe, P, l_split, q, kv, out))
    tiles = l_split // 64
    return {"probe": probe, "us": us, "us_per_64_tile": us / tiles, "rel_err": err,
            "TFLOPs": 2 * P * bm * l_split * (576 + 512) / us / 1e6}


def measure_kernel(P=132, l_split=2048):
    """The split kernel's default 64-row config at the same shape (H 8 x T 8 rows, P splits of l_split entries;
    its merge included, a few us), for the per-tile rate beside the probes."""
    from triton_kernels.mla_attention import mla_attention, pick_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 8, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(1, P * l_split, 576, device="cuda", generator=gen).bfloat16()
    lens = torch.full((1,), P * l_split, dtype=torch.int32, device="cuda")
    mask = torch.full((1, 8, 1), 255, dtype=torch.int32, device="cuda")  # every tree entry visible to every row
    mla_attention(q, kv, lens, mask, 0.1446802, num_splits=P)
    us = graph_us(lambda: mla_attention(q, kv, lens, mask, 0.1446802, num_splits=P))
    return {"probe": ["kernel", *pick_config(64)], "us": us, "us_per_64_tile": us / (l_split // 64),
            "TFLOPs": 2 * P * 64 * l_split * (576 + 512) / us / 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile", action="store_true", help="CPU: sm_90 compile reports only")
    args = parser.parse_args()
    if args.compile:
        for probe in PROBES:
            print(json.dumps(compile_report(probe)), flush=True)
        return
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = [measure_kernel()]
    print(json.dumps(rows[-1]), flush=True)
    for probe in PROBES:
        try:
            rows.append(measure(probe))
        except Exception as exc:  # recorded, not fatal
            rows.append({"probe": probe, "error": str(exc)[:300]})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
        (args.out / "ws_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
