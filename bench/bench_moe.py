"""W4A16 MoE at K2.6 shapes: Triton kernel vs torch dequantise-then-matmul vs a bf16 grouped GEMM.

One TP8 rank (E=384, hidden 7168, intermediate 256) and one EP8 rank (E=48, intermediate 2048), random top-8
routing, M in {1, ..., 512}. Weights are cold in L2: every timed call uses its own routing and the calls rotate
over several layers' worth of expert buffers (>= 4x the L2); Triton and bf16 calls replay under a CUDA graph.
Reports time, distinct experts touched, their weight+scale bytes, GB/s and the fraction of the HBM read bandwidth
measured in the same run (a sum over 4 GiB).

    pytest bench/bench_moe.py --benchmark-only      # pytest-benchmark sweep (CUDA)
    python bench/bench_moe.py --out DIR            # standalone: GPU tests, ceilings, config sweep, JSON + markdown
    python bench/bench_moe.py --out DIR --variants --budget 150   # default vs moe_configs.VARIANTS, TP8 shape
    python bench/bench_moe.py --sass               # CPU: static SASS instructions per weight of those configs
"""

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

SHAPES = {"tp8": dict(E=384, D=7168, I=256), "ep8": dict(E=48, D=7168, I=2048)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TOP_K = 8
CALLS = 16  # calls per captured graph, each with its own routing and (rotating) layer
DEV, DTYPE = "cuda", torch.bfloat16  # a CPU dry run of this script swaps these


def expert_bytes(D, I):
    """INT4 weights plus bf16 group-32 scales of one expert's gate, up and down projections."""
    return 3 * D * I // 2 + 3 * D * I // 32 * 2


def hbm_read_bandwidth(gib=4, reps=10):
    x = torch.rand(gib * 2**30 // 4, device=DEV)
    ms = time_events(lambda: x.sum(), reps)
    return x.numel() * 4 / ms / 1e6  # GB/s


def time_events(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


GAP = torch.zeros(0)  # the small unrelated kernel's operand (`with_gap`), allocated on first use


def with_gap(calls):
    """`calls`, each after a small unrelated kernel (an elementwise op on 4 KB), as the model's MoE call follows
    the router's select, not the previous MoE call (which a chained graph would let it overlap)."""
    global GAP
    if GAP.numel() == 0:
        GAP = torch.zeros(1024, device=DEV)
    return [lambda fn=fn: (GAP.add_(1.0), fn()) for fn in calls]


def gap_alone_ms():
    """Ms a call of the small unrelated kernel alone (`with_gap`), which `time_calls` subtracts."""
    return time_graph(with_gap([lambda: None] * CALLS))


def time_calls(calls, gap_ms=None):
    """`time_graph` of `calls`, or with gap_ms (the small kernels' own ms a call) each call after the small
    unrelated kernel (`with_gap`), its time subtracted."""
    if gap_ms is None:
        return time_graph(calls)
    return max(time_graph(with_gap(calls)) - gap_ms, 1e-6)


def time_graph(calls, reps=10):
    """Median ms per call of `calls` (a list of thunks) captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm up: compile, allocate
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return time_events(graph.replay, reps) / len(calls)


def n_layers(D, I):
    """Layers to rotate over so that top-8 calls read >= 4x the L2 between reuses (2 to 8)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(8, math.ceil(4 * l2 / (TOP_K * expert_bytes(D, I)))))


def random_triton_layer(E, D, I, gen, panels=None):
    """Random repacked experts in the layout of panel widths `panels` (gate/up, down; 0 for the slab layout),
    by default moe_configs.layout_for the device."""
    from triton_kernels.moe_configs import layout_for
    from triton_kernels.moe_w4a16 import SLAB, TritonExperts, to_panels

    panels = tuple(panels) if panels is not None else layout_for(torch.device(DEV))

    def words(k, n, panel, parts):
        kp = -(-k // SLAB) * SLAB
        w = torch.randint(-2**31, 2**31, (E, kp // 8, n), generator=gen, device=DEV, dtype=torch.int32)
        s = (torch.rand(E, kp // 32, n, generator=gen, device=DEV) * 0.01 + 0.001).to(torch.bfloat16)
        return (to_panels(w, panel, parts), to_panels(s, panel, parts) if panel > 1 else s) if panel else (w, s)

    return TritonExperts(*words(D, 2 * I, panels[0], 2), *words(I, D, panels[1], 1), hidden=D, intermediate=I,
                         panel_gate_up=panels[0], panel_down=panels[1])


def random_ct_layer(E, D, I, gen):
    from ops.moe import PackedExperts

    def words(n, k):
        w = torch.randint(-2**31, 2**31, (E, n, k // 8), generator=gen, device=DEV, dtype=torch.int32)
        s = (torch.rand(E, n, k // 32, generator=gen, device=DEV) * 0.01 + 0.001).to(torch.bfloat16)
        return w, s

    return PackedExperts(*words(2 * I, D), *words(D, I))


# Distinct experts a layer that the verify step's tokens touch (TP8, bench/results/step_h200.md), by M tokens
STEP_EXPERTS = {1: 8, 9: 43, 33: 82, 65: 99, 129: 111}


def step_pool(M, E):
    """Pool size P such that M tokens, each routed to top-k experts drawn uniformly from a random pool of P, touch
    as many distinct experts as the verify step does (STEP_EXPERTS, interpolated in log M, clamped at its ends)."""
    ms = sorted(STEP_EXPERTS)
    m = min(max(M, ms[0]), ms[-1])
    hi = next(x for x in ms if x >= m)
    lo = max(x for x in ms if x <= m)
    t = 0.0 if hi == lo else math.log(m / lo) / math.log(hi / lo)
    target = STEP_EXPERTS[lo] + t * (STEP_EXPERTS[hi] - STEP_EXPERTS[lo])
    return min(range(TOP_K, E + 1), key=lambda p: abs(p * (1 - (1 - TOP_K / p) ** M) - target))


def routings(M, E, n, gen, routing="uniform"):
    """n (x, topk ids, weights) of M tokens: top-k of uniform random scores over all E experts, or with
    routing="step" over a random pool of `step_pool(M, E)` experts per call (the verify step's concentration)."""
    out = []
    for _ in range(n):
        pool = E if routing == "uniform" else step_pool(M, E)
        chosen = torch.randperm(E, generator=gen, device=DEV)[:pool]
        ids = chosen[torch.rand(M, pool, generator=gen, device=DEV).topk(TOP_K, dim=-1).indices].int()
        weights = torch.rand(M, TOP_K, generator=gen, device=DEV)
        x = torch.randn(M, SHAPES["tp8"]["D"], generator=gen, device=DEV).to(DTYPE)
        out.append((x, ids, weights))
    return out


def bf16_grouped(x, ids, weights, w_gate_up_t, w_down_t):
    """bf16 baseline: tokens sorted by expert, torch._grouped_mm for gate/up and down, weighted index_add."""
    M, E = x.shape[0], w_gate_up_t.shape[0]
    flat = ids.flatten().long()
    order = flat.argsort()
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    rows = order // TOP_K
    gate_up = torch._grouped_mm(x[rows], w_gate_up_t, offs=offs)  # [P, 2I]
    g, u = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), w_down_t, offs=offs)  # [P, D]
    out = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, y.float() * weights.flatten()[order, None]).to(x.dtype)


VARIANTS = [  # (gate_up BN, num_warps, waves), (down BN, num_warps, waves); waves 0 = no K split
    ((32, 4, 8), (128, 4, 4)),
    ((64, 4, 4), (128, 8, 4)),  # down BN 128 at 8 warps: no shared-memory round trip for the scales
    ((32, 4, 2), (64, 4, 4)),
    ((32, 4, 0), (128, 4, 1)),
]


def sweep_configs(M, I):
    """Configs tried per point (intermediate size I): the table's entry first, then the VARIANTS."""
    from triton_kernels.moe_configs import config_for

    base = config_for(torch.device(DEV), M, intermediate=I)
    variants = [base]
    for (gbn, gw, gwaves), (dbn, dw, dwaves) in VARIANTS:
        cfg = {"BM": base["BM"], "gate_up": dict(base["gate_up"], BN=gbn, num_warps=gw, waves=gwaves),
               "down": dict(base["down"], BN=dbn, num_warps=dw, waves=dwaves)}
        if cfg not in variants:
            variants.append(cfg)
    return variants


# ----------------------------------------------------------------------------------------------- static SASS count

ALU_PIPE = {"LOP3", "SHF", "IADD3", "PRMT", "LEA", "SEL", "ISETP", "VIADD", "PLOP3", "P2R", "R2P", "FSEL", "IABS"}
MEMORY_OPS = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "BAR", "HMMA", "HGMMA")  # per loop trip, reported apart
H200_ISSUE = dict(sms=132, clock_hz=1.98e9, read_gbs=4317.0)  # read bandwidth: bench/results/moe_h200_s2.md


def _cubin_sass(kernel, signature, constexprs, num_warps, num_stages, maxnreg=None, I=256, arch=90):
    """(nvdisasm text, registers, spill bytes, shared bytes) of `kernel` compiled on the CPU as the JIT
    specialises the call at intermediate size I (`moe_w4a16.jit_specialisation`)."""
    import tempfile

    import triton

    from triton_kernels.aot import _ptxas_report, compile_kernel
    from triton_kernels.moe_w4a16 import jit_specialisation

    compiled = compile_kernel(kernel, signature, constexprs, arch, num_warps, num_stages, maxnreg,
                              **jit_specialisation(kernel, signature, constexprs, I))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return (sass, *_ptxas_report(compiled.asm["ptx"], arch), compiled.metadata.shared)


def _loop_opcodes(sass):
    """Opcodes of the largest innermost backward-branch loop (the K loop; a persistent kernel's loop over its work
    items holds it) of a SASS listing."""
    import re

    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", l.strip()))}
    loops = [(labels[m.group(1)], i) for i, l in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", l)) and labels.get(m.group(1), i) < i]
    innermost = [(s, e) for s, e in loops if not any(s < s2 and e2 < e for s2, e2 in loops)]
    start, end = max(innermost, key=lambda span: span[1] - span[0])
    ops = [m.group(1) for l in lines[start:end + 1] if (m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", l))]
    return ops


def sass_count(cfg, shape="tp8"):
    """Per GEMM kernel under `cfg`: SASS instructions per weight per thread in the K loop (sm_90 build), the
    integer-ALU and IMAD shares, and the issue-bound read-bandwidth fraction predicted from them (H200: 4
    schedulers per SM issue one warp instruction a cycle; LOP3/SHF/IADD3/PRMT/... and IMAD run at half that).
    An upper bound: it ignores latency, which the measured defaults show dominates (see the README)."""
    import collections

    from triton_kernels.moe_w4a16 import SLAB, compile_specs

    D, I = SHAPES[shape]["D"], SHAPES[shape]["I"]
    budget = 4 * H200_ISSUE["sms"] * H200_ISSUE["clock_hz"] * 32 / (H200_ISSUE["read_gbs"] * 1e9 * 2)  # per weight
    out = {}
    specs = compile_specs(cfg, arch=90, D=D, I=I)
    for (kernel, (sig, cx, _, warps, stages, cap)), tile in zip(specs, ("gate_up", "down")):
        sass, registers, spills, shared = _cubin_sass(kernel, sig, cx, warps, stages, cap, I)
        ops = collections.Counter(_loop_opcodes(sass))
        weights = SLAB * cx["BN"] * (2 if tile == "gate_up" else 1) / (32 * warps)  # per thread per loop trip
        total, alu, imad = sum(ops.values()), sum(ops[o] for o in ALU_PIPE), ops["IMAD"]
        out[tile] = dict(instr_per_weight=total / weights, alu_per_weight=alu / weights, imad_per_weight=imad / weights,
                         issue_bound_frac=min(1.0, budget / max(total, 2 * alu, 2 * imad) * weights),
                         registers=registers, spill_bytes=spills, shared=shared, top=dict(ops.most_common(8)),
                         memory={o: ops[o] for o in MEMORY_OPS if ops[o]})
    return out


def sass_table(M=1, names=None):
    """sass_count of the sm_90 entry for M tokens and of each of its VARIANTS (or those in `names`; CPU, about
    5 s a config)."""
    from triton_kernels.moe_configs import VARIANTS, config_for, with_variant

    base = config_for(torch.device("cpu"), M)
    chosen = [n for n in VARIANTS if names is None or n in names]
    return {name: sass_count(cfg) for name, cfg in [("default", base)] + [(n, with_variant(base, n)) for n in chosen]}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def measure_point(shape, M, layers, ct_layer, checked_layer, bf16_weights, bw, gen, sweep=True, gap=False):
    """Time one (shape, M): each config checked against the fp32 reference on the repacked checkpoint layer,
    then timed on the rotating random layers; the best correct one is reported. gap: each graphed call (Triton
    and bf16) after a small unrelated kernel, whose own time is subtracted (`time_calls`)."""
    from ops.moe import moe_torch
    from triton_kernels.moe_w4a16 import moe

    E, D, I = SHAPES[shape]["E"], SHAPES[shape]["D"], SHAPES[shape]["I"]
    calls = [(x[:, :D].contiguous(), ids, w) for x, ids, w in routings(M, E, CALLS, gen)]
    touched = sum(ids.unique().numel() for _, ids, _ in calls) / len(calls)
    nbytes = touched * expert_bytes(D, I)
    row = dict(shape=shape, M=M, experts_touched=touched, bytes=nbytes, sweep=[])
    gap_ms = gap_alone_ms() if gap else None
    if gap:
        row["gap_us"] = gap_ms * 1e3
    ref = moe_torch(*calls[0], ct_layer)
    best = None
    for i, cfg in enumerate(sweep_configs(M, I) if sweep else sweep_configs(M, I)[:1]):
        err = rel_err(moe(*calls[0], checked_layer, config=cfg), ref)
        thunks = [lambda c=c, j=j, cfg=cfg: moe(c[0], c[1], c[2], layers[j % len(layers)], config=cfg)
                  for j, c in enumerate(calls)]
        ms = time_calls(thunks, gap_ms)
        row["sweep"].append(dict(config=cfg, us=ms * 1e3, rel_err=err))
        if err < 1e-2 and (best is None or ms < best[0]):
            best = (ms, i, cfg)
    row.update(default_us=row["sweep"][0]["us"], default_rel_err=row["sweep"][0]["rel_err"])
    if best is not None:
        ms = best[0]
        row.update(triton_us=ms * 1e3, triton_config_index=best[1], triton_config=best[2],
                   triton_gbs=nbytes / ms / 1e6, triton_frac=nbytes / ms / 1e6 / bw)
    torch_ms = time_events(lambda: moe_torch(*calls[0], ct_layer), 3, warmup=1)
    row.update(torch_us=torch_ms * 1e3, torch_frac=nbytes / torch_ms / 1e6 / bw)
    if bf16_weights is not None:
        try:
            thunks = [lambda c=c: bf16_grouped(*c, *bf16_weights) for c in calls]
            bf_ms = time_calls(thunks, gap_ms)
            bf_bytes = touched * 3 * D * I * 2
            row.update(bf16_us=bf_ms * 1e3, bf16_bytes=bf_bytes, bf16_frac=bf_bytes / bf_ms / 1e6 / bw)
        except Exception as exc:  # report, keep the sweep going
            row.update(bf16_error=repr(exc)[:300])
    return row


def kernel_breakdown(M, layer, gen, calls=8, config=None):
    """Device time per kernel name (us per call) of eager Triton calls (under `config`, default the table's entry),
    from torch.profiler."""
    from triton_kernels.moe_w4a16 import moe

    inputs = [(x[:, :layer.hidden].contiguous(), ids, w) for x, ids, w in routings(M, layer.num_experts, calls, gen)]
    for x, ids, w in inputs:
        moe(x, ids, w, layer, config=config)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for x, ids, w in inputs:
            moe(x, ids, w, layer, config=config)
        torch.cuda.synchronize()
    return {e.key[:60]: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def run_shape(shape, bw, gen, deadline, sweep, out_rows, save, gap=False):
    E, D, I = SHAPES[shape]["E"], SHAPES[shape]["D"], SHAPES[shape]["I"]
    per_layer = E * expert_bytes(D, I)
    layers = [random_triton_layer(E, D, I, gen) for _ in range(n_layers(D, I))]
    ct_layer = random_ct_layer(E, D, I, gen)
    from triton_kernels.moe_w4a16 import prepare_moe

    checked_layer = prepare_moe(ct_layer.gate_up_packed, ct_layer.gate_up_scale, ct_layer.down_packed,
                                ct_layer.down_scale)
    bf16_weights = None
    if hasattr(torch, "_grouped_mm"):
        w_gu = torch.randn(E, 2 * I, D, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02
        w_dn = torch.randn(E, D, I, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02
        bf16_weights = (w_gu.transpose(1, 2), w_dn.transpose(1, 2))
    rows = []
    for M in MS:
        if time.time() > deadline:
            break
        try:
            row = measure_point(shape, M, layers, ct_layer, checked_layer, bf16_weights, bw, gen, sweep, gap)
        except Exception as exc:  # record the failure, keep measuring the other points
            print(f"{shape} M={M}: {exc!r}", flush=True)
            out_rows.append(dict(shape=shape, M=M, error=repr(exc)[:500]))
            continue
        row.update(layers=len(layers), layer_bytes=per_layer)
        if shape == "tp8" and M in (1, 16, 256):
            try:
                row["kernel_us"] = kernel_breakdown(M, layers[0], gen)
            except Exception as exc:
                row["kernel_us"] = repr(exc)[:300]
        rows.append(row)
        out_rows.append(row)
        save()
        print(f"{shape} M={M:4d} experts={row['experts_touched']:6.1f} "
              f"triton {row.get('triton_us', float('nan')):8.1f} us ({row.get('triton_frac', float('nan')):.0%} of HBM read, "
              f"cfg {row.get('triton_config_index')}) default {row['default_us']:8.1f} us err {row['default_rel_err']:.1e} "
              f"torch {row['torch_us']:9.1f} us bf16 {row.get('bf16_us', float('nan')):8.1f} us", flush=True)
    del layers, ct_layer, checked_layer, bf16_weights
    torch.cuda.empty_cache()
    return rows


def _set_keys(cfg):
    """cfg without its false-valued keys (at both levels): two configs the kernels run alike compare equal."""
    return {k: _set_keys(v) if isinstance(v, dict) else v for k, v in cfg.items() if v is not False}


def compare_variants(bw, gen, deadline, out_rows, save, shape="tp8", names=None, breakdown=(), ms=MS,
                     routing="uniform", gap=False):
    """The measured default against moe_configs.VARIANTS (or those in `names`) at one shape, per M: each config
    checked against the fp32 reference on experts prepared in its layout, timed cold under a CUDA graph on
    random layers in that layout; keeps the fastest correct one per M (`best`). For the configs named in
    `breakdown` ('default' or variants) at M = 1, 16, 256: device time per kernel of eager calls (`kernels`).
    routing: "uniform" or "step" (`routings`); gap: each call after a small unrelated kernel (`with_gap`)."""
    from ops.moe import moe_torch
    from triton_kernels.moe_configs import VARIANTS, config_for, layout_for, with_variant
    from triton_kernels.moe_w4a16 import moe, prepare_moe

    E, D, I = SHAPES[shape]["E"], SHAPES[shape]["D"], SHAPES[shape]["I"]
    ct_layer = random_ct_layer(E, D, I, gen)
    by_layout = {}

    def layout(panels):
        """(rotating random layers, the checked checkpoint layer) in the layout of `panels`, built once."""
        if panels not in by_layout:
            by_layout[panels] = ([random_triton_layer(E, D, I, gen, panels) for _ in range(n_layers(D, I))],
                                 prepare_moe(ct_layer.gate_up_packed, ct_layer.gate_up_scale, ct_layer.down_packed,
                                             ct_layer.down_scale, panels=panels))
        return by_layout[panels]

    unknown = set(names or ()) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; moe_configs.VARIANTS has {list(VARIANTS)}")
    chosen = [n for n in VARIANTS if names is None or n in names]
    for M in ms:
        calls = [(x[:, :D].contiguous(), ids, w) for x, ids, w in routings(M, E, CALLS, gen, routing)]
        touched = sum(ids.unique().numel() for _, ids, _ in calls) / len(calls)
        nbytes = touched * expert_bytes(D, I)
        ref = moe_torch(*calls[0], ct_layer)
        base = config_for(torch.device(DEV), M, intermediate=I)
        row = dict(shape=shape, M=M, routing=routing, gap=gap, experts_touched=touched, bytes=nbytes, variants={})
        if gap:  # the small kernels alone, subtracted from each timing below
            row["gap_us"] = gap_alone_ms() * 1e3
        for name, cfg in [("default", base)] + [(n, with_variant(base, n)) for n in chosen]:
            if time.time() > deadline:
                break
            if cfg.get("decode") and M > 16:  # one block per pair: every pair re-reads its expert
                continue
            if name != "default" and _set_keys(cfg) == _set_keys(base):  # the variant changes nothing here
                continue
            try:
                layers, checked = layout(tuple(cfg.get("panels", layout_for(torch.device(DEV)))))
                err = rel_err(moe(*calls[0], checked, config=cfg), ref)
                thunks = [lambda c=c, j=j, cfg=cfg, layers=layers: moe(*c, layers[j % len(layers)], config=cfg)
                          for j, c in enumerate(calls)]
                ms = time_calls(thunks, row["gap_us"] / 1e3 if gap else None)
                row["variants"][name] = dict(us=ms * 1e3, frac=nbytes / ms / 1e6 / bw, rel_err=err, config=cfg)
                if name in breakdown and M in (1, 16, 256):
                    row["variants"][name]["kernels"] = kernel_breakdown(M, layers[0], gen, config=cfg)
            except Exception as exc:  # record, keep going
                row["variants"][name] = dict(error=repr(exc)[:300])
        ok = {n: v for n, v in row["variants"].items() if v.get("rel_err", 1.0) < 1e-2}
        if ok:
            row["best"] = min(ok, key=lambda n: ok[n]["us"])
        out_rows.append(row)
        save()
        print(f"{shape} M={M:4d} " + " ".join(f"{n} {v['us']:.1f}us {v['frac']:.0%}" if "us" in v else f"{n} FAILED"
                                              for n, v in row["variants"].items()) + f" best {row.get('best')}", flush=True)
        if time.time() > deadline:
            break


def variants_markdown(meta, rows):
    names = list(dict.fromkeys(n for r in rows for n in r.get("variants", {})))
    shape = rows[0]["shape"].upper() if rows else "TP8"
    how = f"{rows[0]['routing']} routing" + (", each call after a small unrelated kernel (its time alone, "
                                             f"{rows[0]['gap_us']:.1f} us a call, subtracted)" if rows[0]["gap"] else "")
    lines = [f"# W4A16 MoE variants vs default ({meta['gpu']}, {meta['date']})", "",
             f"{shape} shape, {how}, cold L2, CUDA graph; HBM read {meta['hbm_read_gbs']:.0f} GB/s measured in this run. "
             "Cells: us (% of HBM read); '-' not run, 'x' failed or wrong.", "",
             "| M | experts | " + " | ".join(names) + " | best |", "|---|---|" + "---|" * len(names) + "---|"]
    for r in sorted(rows, key=lambda r: r["M"]):
        cells = []
        for n in names:
            v = r["variants"].get(n)
            cells.append("-" if v is None else f"{v['us']:.1f} ({v['frac']:.0%})" if v.get("rel_err", 1) < 1e-2 else "x")
        lines.append(f"| {r['M']} | {r['experts_touched']:.1f} | " + " | ".join(cells) + f" | {r.get('best', '-')} |")
    kernels = [(r["M"], n, v["kernels"]) for r in rows for n, v in r["variants"].items() if "kernels" in v]
    if kernels:
        lines += ["", "Device time per kernel, eager calls (torch.profiler), us per call:", ""]
        lines += [f"- M = {M}, {n}: " + ", ".join(f"{k} {us:.1f}" for k, us in times.items()) for M, n, times in kernels]
    return "\n".join(lines) + "\n"


def markdown(meta, rows):
    lines = [f"# W4A16 MoE benchmark ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; HBM read bandwidth measured in this run: "
             f"{meta['hbm_read_gbs']:.0f} GB/s (sum over 4 GiB). Weights cold in L2 (rotating layers and routings), "
             "Triton and bf16 under a CUDA graph; torch path eager (it synchronises). Bytes = touched experts' INT4 "
             "weights + bf16 scales (bf16 baseline: its bf16 weights)."
             + (" Each graphed call after a small unrelated kernel, as the model's MoE follows the router "
                f"({rows[0].get('gap_us', 0):.1f} us a call alone, subtracted)." if rows and "gap_us" in rows[0] else ""),
             "",
             "| shape | M | experts | MB | Triton us | GB/s | % HBM | torch us | % HBM | bf16 grouped us | % HBM |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if "triton_us" in r):
        lines.append(f"| {r['shape']} | {r['M']} | {r['experts_touched']:.1f} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['triton_us']:.1f} | {r['triton_gbs']:.0f} | {r['triton_frac']:.0%} | {r['torch_us']:.0f} | "
                     f"{r['torch_frac']:.0%} | {r.get('bf16_us', float('nan')):.1f} | {r.get('bf16_frac', float('nan')):.0%} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="results folder (required except with --sass)")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    parser.add_argument("--sweep-budget", type=float, default=170.0, help="seconds for the benchmark points")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-tests", action="store_true", help="skip the GPU tests after the benchmark points")
    parser.add_argument("--variants", action="store_true",
                        help="only time the default against moe_configs.VARIANTS at the TP8 shape (about --budget s)")
    parser.add_argument("--names", help="with --variants: comma-separated VARIANTS to time (default: all; "
                                        "'none': the default alone)")
    parser.add_argument("--shape", default="tp8", choices=list(SHAPES), help="with --variants: the shape")
    parser.add_argument("--ms", help="with --variants: comma-separated M, in the order to time them (default: all)")
    parser.add_argument("--ep8-seconds", type=float, default=0.0,
                        help="with --variants: then time the default at the EP8 shape for up to this long")
    parser.add_argument("--ep8-names", default="", help="with --ep8-seconds: VARIANTS timed beside that default")
    parser.add_argument("--breakdown", default="",
                        help="with --variants: comma-separated configs ('default' or variants) timed per kernel")
    parser.add_argument("--routing", default="uniform", choices=["uniform", "step"],
                        help="with --variants: uniform top-k, or the verify step's expert counts (step_pool)")
    parser.add_argument("--gap", action="store_true", help="a small unrelated kernel before each graphed call, its time "
                                                           "subtracted (as the model runs the MoE: after the router)")
    parser.add_argument("--tag", default="", help="with --variants: suffix of the output file names")
    parser.add_argument("--sass", action="store_true", help="CPU only: static SASS counts of the default and variants")
    parser.add_argument("--sass-m", type=int, default=1, help="with --sass: the M bucket whose entry is counted")
    args = parser.parse_args()
    if args.sass:
        print(json.dumps(sass_table(args.sass_m, args.names.split(",") if args.names else None), indent=1))
        return
    if not args.out:
        parser.error("--out is required")
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                calls_per_graph=CALLS, top_k=TOP_K)
    rows = []

    def save():
        with open(os.path.join(args.out, f"moe_{'variants_' + args.shape + args.tag if args.variants else 'results'}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    bw = hbm_read_bandwidth()
    meta["hbm_read_gbs"] = bw
    print(f"HBM read {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(DEV).manual_seed(0)
    if args.variants:
        names = None if not args.names else [] if args.names == "none" else args.names.split(",")
        compare_variants(bw, gen, start + args.budget - 10, rows, save, shape=args.shape, names=names,
                         breakdown=args.breakdown.split(","), ms=[int(m) for m in args.ms.split(",")] if args.ms else MS,
                         routing=args.routing, gap=args.gap)
        with open(os.path.join(args.out, f"moe_variants_{args.shape}{args.tag}.md"), "w") as f:
            f.write(variants_markdown(meta, rows))
        print(variants_markdown(meta, rows), flush=True)
        if args.ep8_seconds:
            ep8 = []
            compare_variants(bw, gen, time.time() + args.ep8_seconds, ep8, save, shape="ep8",
                             names=[n for n in args.ep8_names.split(",") if n])
            rows.extend(ep8)
            save()
            with open(os.path.join(args.out, "moe_variants_ep8.md"), "w") as f:
                f.write(variants_markdown(meta, ep8))
            print(variants_markdown(meta, ep8), flush=True)
        return
    for i, shape in enumerate(SHAPES):
        remaining = args.sweep_budget - (time.time() - start)
        run_shape(shape, bw, gen, time.time() + remaining / (len(SHAPES) - i), not args.no_sweep, rows, save,
                  gap=args.gap)
    with open(os.path.join(args.out, "moe_results.md"), "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows), flush=True)
    if args.no_tests:
        return
    left = args.budget - (time.time() - start) - 5
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_moe_kernel.py"],
                              capture_output=True, text=True, timeout=max(left, 10))
        meta["gpu_tests"] = proc.stdout[-3000:] + proc.stderr[-1000:]
    except subprocess.TimeoutExpired as exc:
        meta["gpu_tests"] = f"timed out after {left:.0f} s: " + (exc.stdout or b"")[-2000:].decode(errors="replace")
    print(meta["gpu_tests"][-1500:], flush=True)
    save()


@pytest.fixture(scope="module")
def tp8():
    gen = torch.Generator(DEV).manual_seed(0)
    E, D, I = SHAPES["tp8"].values()
    return gen, [random_triton_layer(E, D, I, gen) for _ in range(4)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", MS, ids=lambda m: f"M{m}")
def test_moe_tp8(benchmark, tp8, M):
    """pytest-benchmark: host time of one graph replay of CALLS cold-weight Triton calls (TP8 rank)."""
    from triton_kernels.moe_w4a16 import moe

    gen, layers = tp8
    calls = [(x.contiguous(), ids, w) for x, ids, w in routings(M, SHAPES["tp8"]["E"], CALLS, gen)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for j, c in enumerate(calls):
            moe(*c, layers[j % len(layers)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j, c in enumerate(calls):
            moe(*c, layers[j % len(layers)])

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=20, warmup_rounds=2)
    touched = sum(ids.unique().numel() for _, ids, _ in calls) / len(calls)
    benchmark.extra_info.update(experts_touched=touched, bytes=touched * expert_bytes(7168, 256), calls=CALLS)


if __name__ == "__main__":
    main()
