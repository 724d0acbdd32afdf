"""MLA tree attention on the GPU: Triton kernel vs roofline (and the torch reference), cache cold in L2, CUDA graph.

Standalone: `python bench/bench_attention.py --out DIR [--tune] [--quick]` measures the ceilings (HBM read
bandwidth: a sum over 4 GiB; bf16 matmul rate: 8192^3) and the sweep T x context x H at B=1, checks each
case against the fp32 reference, and writes attention.json + attention.md. --tune also times candidate
configs and split counts per case; --focus a short tune at 32k/128k; --round2 the round-2 options (all split
counts, bf16 partials, small configs, the whole-wave split rule) beside the default; --defaults the committed
defaults alone at 32k/128k (the short re-measure); --step also split counts and the other tile load path at the 4k
step shapes; --tma the other load path at 32k. Every mode also times the verify step's shapes (STEP_CASES: T =
budget + 1 at 32k and 4k, the cache padded past the length as in bench_step.py). As a pytest-benchmark sweep:
`pytest bench/bench_attention.py` (GPU only).

Each case captures one CUDA graph of R launches over R different caches (R * cache >= 256 MiB, so every
launch finds its cache cold in L2, as the model's layers would) and reports graph time / R.
"""

import argparse
import importlib.util
import json
import math
import multiprocessing
import platform
import random
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
import triton

from ops.attention import mla_attention_torch, pack_tree_mask
from triton_kernels import mla_attention as mk
from triton_kernels.moe_configs import sm_count

SCALE = 0.1446802
CONTEXTS = (1024, 8192, 32768, 131072)
TREE_SIZES = (1, 8, 32, 64, 128)
HEADS = (8, 64)
ROTATE_BYTES = 256 << 20  # caches cycled per measurement, > L2
PREFILL = ((4096, 8, 4096), (32768, 8, 2048))  # (L, H, T) causal prompt chunks, mask None
TORCH_REF_MAX = 1 << 28  # time the torch reference only where H*T*L is at most this (its scores are fp32)
CANDIDATES = {  # (BLOCK_M, BLOCK_N, warps, stages, BLOCK_DV, UNCHAIN) tried by --tune, by query rows
    16: [(16, 32, 4, 3, 512, False), (16, 32, 4, 4, 512, False), (16, 64, 4, 2, 512, False)],
    None: [(64, 64, 8, 2, 512, False), (64, 64, 8, 2, 512, True), (64, 32, 8, 3, 512, True),
           (64, 32, 8, 2, 512, True)],
}
FOCUS = {  # --focus: the measured defaults beside the unchained configs (a short run)
    16: [(16, 32, 4, 3, 512, False)],
    None: [(64, 64, 8, 2, 512, False), (64, 64, 8, 2, 512, True), (64, 32, 8, 3, 512, True)],
}
PER_SM = (0.5, 1, 2, 4)  # programs per SM (split counts) tried by --tune
ROUND2_SMALL = {  # --round2, 16 < T*H <= 64: "small", mma.sync tiles; "dv256", 4-warp wgmma programs of 110 KB
    "small": [(16, 32, 4, 3, 512, False), (32, 32, 4, 2, 512, False)],  # that split the values, two per SM (one's
    "dv256": [(64, 16, 4, 2, 256, False)],  # softmax may overlap the other's MMAs)
}
HALF_PARTIALS_MAX_ROWS = 64  # --tune also times bf16 per-split outputs where T*H is at most this (merge-heavy cases)
# --round2: (context, H, T, pad) as in bench_step.py's TP8 verify: length context + T in a cache of
# context + T + pad entries (its cache is sized for the largest context and bucket)
STEP_CACHE = 32898  # entries of bench_step.py's cache (32k context + the largest tree + 1)
STEP_CASES = ((32768, 8, 33, 97), (32768, 8, 9, 121), (32768, 8, 65, 65), (32768, 8, 1, 129)) + tuple(
    (4096, 8, T, STEP_CACHE - 4096 - T) for T in (1, 9, 33, 65, 129))  # 4k: budgets 0-128 (issue #7's step)
# --step: split counts timed at the 4k step shapes (by T), for the actual ~4.1k entries (the kernel splits the
# length, not the padded cache): at T 1, 129 splits is one 32-entry tile each (the default's 258 busy ones)
STEP_SPLITS = {1: (8, 16, 32, 64, 129), 9: (16, 33, 66), 33: (13, 26), 65: (7, 14), 129: (4, 7)}
WAVES_RULE = (8, True)  # --round2 "waves": mk.SPLIT_RULE candidate (length window, whole-wave counts)


def ceilings():
    """Measured HBM read bandwidth (GB/s) and bf16 matmul rate (TFLOP/s) of this GPU."""
    x = torch.randn(2 << 30, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    read_ms = triton.testing.do_bench(lambda: x.sum(), warmup=50, rep=300, return_mode="median")
    del x
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"read_GBps": (4 << 30) / read_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def random_tree_mask(B, T, seed):
    """A random tree (each node's parent is a uniformly random earlier node), packed [B, T, ceil(T/32)]."""
    rng = random.Random(seed)
    dense = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        parents = [-1] + [rng.randrange(t) for t in range(1, T)]
        for t in range(T):
            n = t
            while n >= 0:
                dense[b, t, n] = True
                n = parents[n]
    return pack_tree_mask(dense).cuda()


def make_inputs(L, H, T, B=1, seed=0, causal=False, pad=0):
    """q, caches (rotated, each [B, L + pad, 576]), lengths (L), tree mask."""
    torch.manual_seed(seed)
    rotate = min(256, max(2, math.ceil(ROTATE_BYTES / (B * (L + pad) * 576 * 2))))
    caches = [torch.randn(B, L + pad, 576, dtype=torch.bfloat16, device="cuda") for _ in range(rotate)]
    q = torch.randn(B, T, H, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q, caches, lens, None if causal else random_tree_mask(B, T, seed)


def graph_time_us(fn, caches, replays=10):
    """Median time per call of fn(cache) over a CUDA graph cycling through caches (each cold in L2)."""
    for kv in caches[:2]:
        fn(kv)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for kv in caches:
            fn(kv)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(caches))
    del graph
    return sorted(times)[len(times) // 2]


def case_costs(L, H, T, B, ceil, causal=False):
    cache_bytes = B * L * 576 * 2
    io_bytes = B * T * H * (576 + 512) * 2
    keys = L - T + (T + 1) / 2 if causal else L  # mean keys per query (the tree part of a decode is counted full)
    flops = 2 * B * H * T * keys * (576 + 512)
    roof_us = max((cache_bytes + io_bytes) / (ceil["read_GBps"] * 1e3), flops / (ceil["bf16_TFLOPs"] * 1e6))
    return cache_bytes, io_bytes, flops, roof_us


def candidates(rows, table=CANDIDATES):
    for max_rows, cfgs in table.items():
        if max_rows is None or rows <= max_rows:
            return cfgs
    return []


def run_case(L, H, T, ceil, B=1, causal=False, time_torch=True, pad=0):
    q, caches, lens, mask = make_inputs(L, H, T, B, causal=causal, pad=pad)
    rows = T * H
    out = mk.mla_attention(q, caches[0], lens, mask, SCALE)
    ref = mla_attention_torch(q.float(), caches[0].float(), lens, mask, SCALE)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    del ref
    us = graph_time_us(lambda kv: mk.mla_attention(q, kv, lens, mask, SCALE), caches)
    cache_bytes, io_bytes, flops, roof_us = case_costs(L, H, T, B, ceil, causal)
    row = {
        "L": L, "H": H, "T": T, "B": B, "causal": causal, "rotate": len(caches), "pad": pad,
        "config": list(mk.pick_config(rows)),
        "splits": default_choice(rows, B, L + pad, sm_count(q.device), mk._arch(), 0 if causal else T)[1],
        "rel_err": err, "us": us, "cache_bytes": cache_bytes, "GBps": (cache_bytes + io_bytes) / us / 1e3,
        "TFLOPs": flops / us / 1e6, "roofline_us": roof_us, "x_roofline": us / roof_us,
        "frac_read_bw": (cache_bytes + io_bytes) / us / 1e3 / ceil["read_GBps"],
    }
    if time_torch and H * T * L <= TORCH_REF_MAX and not pad:
        row["torch_us"] = 1e3 * triton.testing.do_bench(
            lambda: mla_attention_torch(q, caches[0], lens, mask, SCALE), warmup=5, rep=30, return_mode="median")
    return row


def focus_runs(row, sms, table=CANDIDATES, direct=True):
    """(label, config, splits, partials) of every candidate config at each PER_SM (programs per SM; one
    split only if direct), also with bf16 partials where T*H <= HALF_PARTIALS_MAX_ROWS, and the committed default."""
    L, B, rows = row["L"], row["B"], row["T"] * row["H"]
    runs = []
    for cfg in candidates(rows, table):
        base = B * triton.cdiv(rows, cfg[0]) * (512 // cfg[4])
        for per_sm in PER_SM:
            splits = mk.choose_splits(base, L, cfg[1], sms, per_sm)
            if (direct or splits > 1) and not any(r[1:3] == (cfg, splits) for r in runs):
                half = [torch.bfloat16] if rows <= HALF_PARTIALS_MAX_ROWS and splits > 1 else []
                runs += [(per_sm, cfg, splits, dt) for dt in [torch.float32] + half]
    cfg, splits, partials = default_choice(rows, B, L + row.get("pad", 0), sms, tree=tree_of(row))
    if cfg in candidates(rows, table) and not any(r[1:3] == (cfg, splits) for r in runs):  # the default, always timed
        runs.append(("default", cfg, splits, getattr(torch, partials)))
    return runs


def round2_runs(row, sms):
    """Round-2 candidates (label, config, splits, partials): the committed default, with the model's split count
    over all counts, with bf16 partials (T*H > 64), the ROUND2_SMALL configs where T*H <= 64, and the split count
    of WAVES_RULE. (Lazy rescale and programmatic dependent launch, timed here in session 3, were slower and are
    gone from the kernel: bench/results/attention_h200_run5.md.)"""
    L, B, rows = row["L"] + row.get("pad", 0), row["B"], row["T"] * row["H"]
    cfg, splits, partials = default_choice(rows, B, L, sms, tree=tree_of(row))
    entry = mk.entry_for(rows, 90)
    dt = getattr(torch, partials)
    scheme = split_scheme(tree_of(row), entry)
    every = mk.default_splits(entry, rows, B, L, sms, 90, dt.itemsize, every=True, **scheme)
    waves = mk.default_splits(entry, rows, B, L, sms, 90, dt.itemsize, rule=WAVES_RULE, **scheme)
    runs = [("default", cfg, splits, dt)]
    if every != splits:
        runs.append(("all-S", cfg, every, dt))
    if waves != splits:
        runs.append(("waves", cfg, waves, dt))
    if dt != torch.bfloat16 and splits > 1:
        runs.append(("bf16", cfg, splits, torch.bfloat16))
    for name, configs in ROUND2_SMALL.items() if 16 < rows <= 64 else ():
        for small in configs:
            base = B * triton.cdiv(rows, small[0]) * (512 // small[4])
            for per_sm in (1, 2):
                runs.append((f"{name} x{per_sm}", small, mk.choose_splits(base, L, small[1], sms, per_sm),
                             torch.bfloat16))
    return runs


def step_runs(row, sms):
    """--step candidates (label, config, splits, partials[, tma]) at a 4k step shape: the default, the STEP_SPLITS
    counts (also with bf16 partials where the default's are fp32) and the other tile load path (tma_runs)."""
    T = row["T"]
    cfg, splits, partials = default_choice(T * row["H"], row["B"], row["L"] + row.get("pad", 0), sms,
                                           tree=tree_of(row))
    dt = getattr(torch, partials)
    runs = [("default", cfg, splits, dt)] + [(f"S{n}", cfg, n, dt) for n in STEP_SPLITS[T]]
    if dt != torch.bfloat16:
        runs += [(f"bf16 S{n}", cfg, n, torch.bfloat16) for n in STEP_SPLITS[T]]
    return runs + tma_runs(row, sms)


def tma_runs(row, sms):
    """--tma: the default config and split count with the other tile load path (TMA <-> pointers), where the default
    uses TMA or T*H > 16 (the 16-row config's TMA is untimed)."""
    rows = row["T"] * row["H"]
    cfg, splits, partials = default_choice(rows, row["B"], row["L"] + row.get("pad", 0), sms, tree=tree_of(row))
    tma = mk.entry_for(rows, 90).tma
    return [("pointers" if tma else "tma", cfg, splits, getattr(torch, partials), not tma)] if tma or rows > 16 else []


def step_rows():
    return [{"L": L + T, "B": 1, "T": T, "H": H, "pad": pad} for L, H, T, pad in STEP_CASES if L < 8192]


def step_jobs(sms):
    """The kernel variants --step and --tma run: (H, config, splits, causal, 16-bit partials[, tma])."""
    jobs = set()
    for row in step_rows():
        for _, cfg, splits, dt, *tma in step_runs(row, sms):
            jobs.add((row["H"], cfg, 1 if splits == 1 else mk.merge_blocks(splits)[0], False, dt == torch.bfloat16,
                      *tma))
    for H in HEADS:  # --tma's variants (64-row config: fp32 partials above 64 rows, bf16 up to it)
        jobs |= {(H, mk.pick_config(64), 2, False, half, not mk.entry_for(64, 90).tma) for half in (False, True)}
    return jobs


def tma_table(report):
    """Lines: the default beside --tma's run (the other tile load path) per case."""
    rows = [r for r in report["cases"] if r.get("tma")]
    lines = ["", "The other tile load path of the unmasked loop (--tma: tma or pointers)", "",
             "| L | H | T | default us | other path | us | x roofline |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tma"][0]
        tma_s = f"{t['us']:.1f} | {t['us'] / r['roofline_us']:.2f}" if "us" in t else f"{t.get('error', '-')[:80]} | -"
        lines.append(f"| {r['L']} | {r['H']} | {r['T']} | {r['us']:.1f} | {t['per_sm']} | {tma_s} |")
    return lines if rows else []


def step_table(report):
    """Lines: each --step run's time (x roofline) per 4k step shape."""
    rows = [r for r in report["cases"] if r.get("step")]
    if not rows:
        return []
    lines = ["", "Step shapes at 4k (--step): us (x roofline) per run; S = splits, bf16 = 16-bit partials, tma / "
             "pointers = the other tile load path", "", "| L | H | T | runs |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{t['per_sm']}: {t['us']:.1f} ({t['us'] / r['roofline_us']:.2f}x)" if "us" in t else
                 f"{t['per_sm']}: {t.get('error', '-')[:60]}" for t in r["step"]]
        lines.append(f"| {r['L']} (+{r['pad']}) | {r['H']} | {r['T']} | " + "; ".join(cells) + " |")
    return lines


def merge_time_us(B, rows, splits, partials):
    """The merge kernel alone for one case's split count (graph of 8 launches over the same partials, so L2-warm
    like the partials the split kernel has just written): the share of the merge in the default's time."""
    o_part = torch.randn(B, splits, rows, 512, device="cuda").to(partials)
    lse_part = torch.randn(B, splits, rows, device="cuda")
    out = torch.empty(B, rows, 512, dtype=torch.bfloat16, device="cuda")
    block_s, block_d, warps = mk.merge_blocks(splits)
    grid = (rows, 512 // block_d, B)
    return graph_time_us(lambda _: mk._merge_kernel[grid](o_part, lse_part, out, rows, splits, BLOCK_S=block_s,
                                                          BLOCK_D=block_d, num_warps=warps), [None] * 8)


def tune_case(row, runs):
    """Time each run (label, config, splits, partials) of one measured case and check it against
    the fp32 reference."""
    L, H, T, B = row["L"], row["H"], row["T"], row["B"]
    q, caches, lens, mask = make_inputs(L, H, T, B, causal=row["causal"], pad=row.get("pad", 0))
    ref = mla_attention_torch(q.float(), caches[0].float(), lens, mask, SCALE).double()
    results = []
    for label, cfg, splits, dt, *tma in runs:  # tma: (True/False,) for the --step and --tma runs of a load path
        entry = {"config": list(cfg), "splits": splits, "per_sm": label, "partials": str(dt).split(".")[-1]}
        kwargs = dict(num_splits=splits, config=cfg, partials=dt)
        if tma:
            entry["tma"] = kwargs["tma"] = tma[0]
        try:
            out = mk.mla_attention(q, caches[0], lens, mask, SCALE, **kwargs)
            entry["rel_err"] = ((out.double() - ref).norm() / ref.norm()).item()
            entry["us"] = graph_time_us(lambda kv: mk.mla_attention(q, kv, lens, mask, SCALE, **kwargs), caches)
        except Exception as exc:  # a config that does not fit this GPU's resources is recorded, not fatal
            entry["error"] = str(exc)[:200]
        results.append(entry)
    return results


def markdown(report):
    c = report["ceilings"]
    lines = [
        f"# MLA tree attention, {report['gpu']}, {report['date']}",
        "",
        f"torch {report['torch']}, triton {report['triton']}. Ceilings measured in the same run: read "
        f"{c['read_GBps']:.0f} GB/s (sum over 4 GiB), bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s (8192^3). "
        "B=1, random trees, cache cold in L2 (graph over rotated caches), bf16.",
        "",
        "| L | H | T | us | GB/s | frac read BW | TFLOP/s | roofline us | x roofline | best tuned us (cfg, splits) "
        "| tuned x roofline | torch us | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        ok = [t for t in r.get("tuned", []) if "us" in t]
        best = min(ok, key=lambda t: t["us"]) if ok else None
        best_s = (f"{best['us']:.1f} ({best['config']}, {best['splits']}, {best.get('partials', 'float32')}, "
                  f"{best.get('per_sm')}, err {best.get('rel_err', float('nan')):.1e})"
                  if best else "-")
        best_x = f"{best['us'] / r['roofline_us']:.2f}" if best else "-"
        torch_s = f"{r['torch_us']:.0f}" if "torch_us" in r else "-"
        kind = " (prefill)" if r.get("causal") else ""
        pad = f" (+{r['pad']})" if r.get("pad") else ""
        lines.append(f"| {r['L']}{pad} | {r['H']} | {r['T']}{kind} | {r['us']:.1f} | {r['GBps']:.0f} "
                     f"| {r['frac_read_bw']:.2f} | {r['TFLOPs']:.0f} | {r['roofline_us']:.1f} | {r['x_roofline']:.2f} "
                     f"| {best_s} | {best_x} | {torch_s} | {r['rel_err']:.1e} |")
    return "\n".join(lines + round2_table(report) + step_table(report) + tma_table(report)) + "\n"


def round2_table(report):
    """Lines of a table: each --round2 label's time (and x roofline) per case; none without round-2 timings."""
    labels = ["default", "waves", "all-S", "bf16", "small x1", "small x2", "dv256 x1", "dv256 x2", "merge alone"]
    rows = [r for r in report["cases"] if any(t.get("per_sm") == "default" for t in r.get("tuned", []))]
    if not rows:
        return []
    lines = ["", "Round 2 (us, x roofline; splits): " + ", ".join(labels), "",
             "| L | H | T | " + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(labels)]
    for r in rows:
        cells = []
        for label in labels:
            hits = sorted((t for t in r["tuned"] if t.get("per_sm") == label and "us" in t), key=lambda t: t["us"])
            if label == "merge alone" and "merge_us" in r:
                hits = [{"us": r["merge_us"], "splits": r.get("splits", "-")}]
            cells.append(f"{hits[0]['us']:.1f} ({hits[0]['us'] / r['roofline_us']:.2f}x; {hits[0]['splits']})"
                         if hits else "-")
        pad = f" (+{r['pad']})" if r.get("pad") else ""
        lines.append(f"| {r['L']}{pad} | {r['H']} | {r['T']} | " + " | ".join(cells) + " |")
    return lines


def split_scheme(tree, entry, arch=90):
    """default_splits' tree and tail keywords as mla_attention picks them (tree: T under a tree mask, 0 causal)."""
    return dict(tree=tree, tail=bool(tree) and mk.tail_split_default(tree, entry.config[1], arch))


def default_choice(rows, B, L, sms, arch=90, tree=0):
    """(config, splits, partials name) the committed CONFIGS and split rule pick for one case (tree: its T under a
    tree mask, 0 for a causal one)."""
    entry = mk.entry_for(rows, arch)
    partials = entry.partials or torch.bfloat16
    splits = mk.default_splits(entry, rows, B, L, sms, arch, partials.itemsize, **split_scheme(tree, entry, arch))
    return entry.config, splits, str(partials).split(".")[-1]


def parse_case(case):
    """(L, H, T, pad) of a probe's "L,H,T[,pad]" argument."""
    return tuple((list(map(int, case.split(","))) + [0])[:4])


def checked_time_us(call, caches, ref):
    """(us, rel_err) of call(kv): graph_time_us over caches, the error of call(caches[0]) against ref (fp64)."""
    err = ((call(caches[0]).double() - ref).norm() / ref.norm()).item()
    return graph_time_us(call, caches), err


def module_from_file(path, name=None):
    """The Python module in file `path`, imported as `name` (default: the file's stem): for kernels' copies, e.g. the
    Gluon split kernel of another commit (`git show REF:triton_kernels/mla_gluon.py > FILE`) in a same-call A/B."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_probe_json(out, name, rows, **meta):
    """rows to out/name as {meta (GPU, date, and these), rows}, for the bench/probe_*.py scripts."""
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **meta)
    (out / name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def tree_of(row):
    """A case's tree size (0 for a causal one)."""
    return 0 if row.get("causal") else row["T"]


def committed_defaults(report, arch=90):
    """Per case: the config and split count the committed CONFIGS choose, and its time measured in `report`."""
    sms = report.get("sms", 132)  # the H200's 132 SMs (also what the recorded split counts imply)
    for r in report["cases"]:
        cfg, splits, partials = default_choice(r["T"] * r["H"], r["B"], r["L"] + r.get("pad", 0), sms, arch,
                                               tree_of(r))
        hits = [t["us"] for t in r.get("tuned", []) if "us" in t and t["config"] == list(cfg) and t["splits"] == splits
                and t.get("partials", "float32") == partials and not t.get("rescale_tau") and not t.get("pdl")]
        yield r, cfg, splits, hits[0] if hits else None


def summary(report):
    c = report["ceilings"]
    lines = [
        f"# MLA tree attention with the committed sm_90 configs, {report['gpu']}, {report['date']}",
        "",
        f"torch {report['torch']}, triton {report['triton']}. Ceilings from the same run: read {c['read_GBps']:.0f} "
        f"GB/s (sum over 4 GiB), bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s (8192^3). B=1, random trees (prefill: "
        "causal), bf16, cache cold in L2 (one CUDA graph over rotated caches). Each time is the one measured in that "
        "run for exactly the config and split count the committed CONFIGS pick (from the --tune timings).",
        "",
        "| L | H | T | config (BM, BN, warps, stages, DV) | splits | us | roofline us | x roofline | frac read BW "
        "| TFLOP/s | torch us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, cfg, splits, us in committed_defaults(report):
        kind = " (prefill)" if r.get("causal") else f" (cache +{r['pad']})" if r.get("pad") else ""
        torch_s = f"{r['torch_us']:.0f}" if "torch_us" in r else "-"
        if us is None:
            lines.append(f"| {r['L']} | {r['H']} | {r['T']}{kind} | {list(cfg)} | {splits} | not measured | "
                         f"{r['roofline_us']:.1f} | - | - | - | {torch_s} |")
            continue
        bw = r["GBps"] * r["us"] / us / c["read_GBps"]
        tflops = r["TFLOPs"] * r["us"] / us
        lines.append(f"| {r['L']} | {r['H']} | {r['T']}{kind} | {list(cfg)} | {splits} | {us:.1f} | "
                     f"{r['roofline_us']:.1f} | {us / r['roofline_us']:.2f} | {bw:.2f} | {tflops:.0f} | {torch_s} |")
    return "\n".join(lines) + "\n"


def _warm(job):
    """Compile one kernel variant (run in a worker so compiles overlap; the main process hits Triton's disk cache)."""
    H, cfg, splits, causal, half, *tma = job  # tma: (True/False,) for the --step and --tma variants
    try:
        _run_tiny(H, cfg, splits, causal, torch.bfloat16 if half else torch.float32, *tma)
    except Exception as exc:  # recorded; the sweep reports the same failure where it matters
        return f"{job}: {exc}"[:300]
    return None


def _run_tiny(H, cfg, splits, causal, partials, tma=None):
    q = torch.randn(1, 1, H, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(1, 256, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((1,), 256, dtype=torch.int32, device="cuda")
    mask = None if causal else random_tree_mask(1, 1, 0)
    mk.mla_attention(q, kv, lens, mask, SCALE, num_splits=splits, config=cfg, partials=partials, tma=tma)
    torch.cuda.synchronize()


def round2_jobs(contexts, heads, tree_sizes, sms):
    """The kernel variants --round2 runs: (H, config, splits, causal, 16-bit partials)."""
    rows = [{"L": L, "B": 1, "T": T, "H": H} for L in contexts for H in heads for T in tree_sizes]
    rows += [{"L": L + T, "B": 1, "T": T, "H": H, "pad": pad} for L, H, T, pad in STEP_CASES]
    return {(row["H"], cfg, 1 if splits == 1 else mk.merge_blocks(splits)[0], False, dt == torch.bfloat16)
            for row in rows for _, cfg, splits, dt in round2_runs(row, sms)}  # splits: one per compiled merge


def precompile(heads, tree_sizes, tune, workers, prefill=True, table=CANDIDATES, extra=()):
    """Compile the kernel variants a sweep runs (split and direct; prefill's causal ones unless prefill=False), and
    `extra` jobs."""
    jobs = set(extra)
    for H in heads:
        for T in tree_sizes:
            default = mk.pick_config(T * H)
            cfgs = set(candidates(T * H, table)) if tune else set()
            for cfg in cfgs | {default}:
                jobs |= {(H, cfg, 2, False, False)} | ({(H, cfg, 1, False, False)} if prefill else set())
                if tune and T * H <= HALF_PARTIALS_MAX_ROWS:
                    jobs.add((H, cfg, 2, False, True))
            jobs |= {(H, default, 1, False, False), (H, default, 2, False, True)}  # one split, 16-bit partials
    for L, H, T in PREFILL if prefill else ():
        for cfg in (set(candidates(T * H)) if tune else set()) | {mk.pick_config(T * H)}:
            jobs |= {(H, cfg, 1, True, False), (H, cfg, 2, True, False)}
    jobs |= {(8, mk.pick_config(8), 2**k + 1, False, False) for k in range(1, 9)}  # the merge's BLOCK_S variants
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        failures = [f for f in pool.map(_warm, compile_order(jobs)) if f]
    for failure in failures:
        print("precompile failed:", failure, flush=True)
    return len(jobs)


def compile_order(jobs):
    """Jobs with one per split-kernel variant first, so the later ones (merge variants) find it in the cache."""
    first, rest = {}, []
    for job in sorted(jobs):
        H, cfg, splits, causal, half = job[:5]
        key = (H, cfg, splits == 1, causal, half, *job[5:])
        rest.append(job) if key in first else first.setdefault(key, job)
    return list(first.values()) + rest


def run_default(report, L, H, T, causal, pad, focus, out):
    """Time one case's default and add it to the report (written at once)."""
    row = run_case(L, H, T, report["ceilings"], causal=causal, time_torch=not focus, pad=pad)
    row["done_at_s"] = round(time.time() - report["start"], 1)  # since the sweep began (for re-measure budgets)
    report["cases"].append(row)
    print(json.dumps(row), flush=True)
    (out / "attention.json").write_text(json.dumps(report, indent=1))
    torch.cuda.empty_cache()


def sweep(contexts, heads, tree_sizes, tune, out, focus=False, deadline=None, round2=False, step=False, tma=False):
    report = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count, "start": time.time(),
        "ceilings": ceilings(), "cases": [],
    }
    print("ceilings", report["ceilings"], flush=True)
    cases = [(L, H, T, False, 0) for L in contexts for H in heads for T in tree_sizes]
    cases += [] if focus else [(L, H, T, True, 0) for L, H, T in PREFILL]
    cases += [(L + T, H, T, False, pad) for L, H, T, pad in STEP_CASES]
    late = [c for c in cases if c[0] > 65536] if step or tma else []  # --step/--tma: 128k after their candidates
    for L, H, T, causal, pad in [c for c in cases if c not in late]:
        run_default(report, L, H, T, causal, pad, focus, out)
    # after the defaults of their cases (a faulting candidate cannot cost them); --step: the 4k step shapes
    for row in report["cases"] if step else []:
        if row.get("pad") and row["L"] < 8192:
            row["step"] = tune_case(row, step_runs(row, report["sms"]))
            print("step", row["L"], row["T"], json.dumps(row["step"]), flush=True)
            (out / "attention.json").write_text(json.dumps(report, indent=1))
    for row in report["cases"] if tma else []:  # --tma: the 64-row config's sweep cases at 32k
        if row["L"] == 32768 and row["T"] * row["H"] > 16 and not row.get("pad") and not row["causal"]:
            row["tma"] = tune_case(row, tma_runs(row, report["sms"]))
            print("tma", row["L"], row["H"], row["T"], json.dumps(row["tma"]), flush=True)
            (out / "attention.json").write_text(json.dumps(report, indent=1))
    for L, H, T, causal, pad in late:
        run_default(report, L, H, T, causal, pad, focus, out)
    # round 2: the step's shapes, then the fewest rows first
    order = report["cases"]
    if round2:
        order = sorted(order, key=lambda r: (not r.get("pad"), r["T"] * r["H"], r["L"]))
    for row in order if tune else []:
        if deadline is not None and time.time() > deadline:
            print("budget spent: not tuned", row["L"], row["H"], row["T"], flush=True)
            continue
        sms = report["sms"]
        runs = round2_runs(row, sms) if round2 else focus_runs(row, sms, FOCUS if focus else CANDIDATES, not focus)
        row["tuned"] = tune_case(row, runs)
        _, splits, partials = default_choice(row["T"] * row["H"], row["B"], row["L"] + row.get("pad", 0), sms,
                                             tree=tree_of(row))
        if round2 and splits > 1:
            row["merge_us"] = merge_time_us(row["B"], row["T"] * row["H"], splits, getattr(torch, partials))
        best = min((t for t in row["tuned"] if "us" in t), key=lambda t: t["us"], default=None)
        print("tuned", row["L"], row["H"], row["T"], row["us"], best, flush=True)
        (out / "attention.json").write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tune", action="store_true", help="also time candidate configs and split counts")
    parser.add_argument("--quick", action="store_true", help="32k and 128k only")
    parser.add_argument("--focus", action="store_true",
                        help="--tune --quick over FOCUS's configs, without prefill, torch timing and one-split variants")
    parser.add_argument("--round2", action="store_true",
                        help="like --focus, timing round2_runs (all split counts, bf16 partials, small configs, "
                             "whole waves) and STEP_CASES")
    parser.add_argument("--defaults", action="store_true",
                        help="the committed defaults alone at 32k/128k and STEP_CASES (no tuning, torch or prefill)")
    parser.add_argument("--step", action="store_true",
                        help="also time step_runs (split counts, bf16 partials, the other load path) at the 4k STEP_CASES")
    parser.add_argument("--contexts", type=int, nargs="+", help="the sweep's contexts instead of the mode's")
    parser.add_argument("--tma", action="store_true",
                        help="also time the default with the other tile load path (TMA <-> pointers) at the 64-row "
                             "config's 32k cases")
    parser.add_argument("--budget", type=float, help="seconds from the start after which no further case is tuned")
    parser.add_argument("--workers", type=int, default=12, help="processes compiling kernel variants up front")
    parser.add_argument("--with-tests", action="store_true", help="first run tests/test_attention_kernel.py here")
    parser.add_argument("--summarize", type=Path, help="no GPU: render a run's JSON for the committed configs")
    args = parser.parse_args(argv)
    if args.summarize:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_summary.md").write_text(summary(json.loads(args.summarize.read_text())))
        return
    if args.with_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "-k", "not sm120",
                                "tests/test_attention_kernel.py"], capture_output=True, text=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_tests.log").write_text(tests.stdout + tests.stderr)
        print(tests.stdout[-3000:], flush=True)
    args.focus = args.focus or args.round2 or args.defaults
    args.tune, args.quick = (args.tune or args.focus) and not args.defaults, args.quick or args.focus
    contexts = args.contexts or (CONTEXTS[2:] if args.quick else CONTEXTS)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    sms = sm_count(torch.device("cuda"))
    extra = (round2_jobs(contexts, HEADS, TREE_SIZES, sms) if args.round2 else set()) | (
        step_jobs(sms) if args.step or args.tma else set())
    print("precompiled", precompile(HEADS, TREE_SIZES, args.tune and not args.round2, args.workers,
                                    prefill=not args.focus, table=FOCUS if args.focus else CANDIDATES, extra=extra),
          "variants in", f"{time.time() - start:.0f}s", flush=True)
    deadline = start + args.budget if args.budget else None
    report = sweep(contexts, HEADS, TREE_SIZES, args.tune, args.out, focus=args.focus, deadline=deadline,
                   round2=args.round2, step=args.step, tma=args.tma)
    (args.out / "attention.json").write_text(json.dumps(report, indent=1))
    (args.out / "attention.md").write_text(markdown(report))
    print(markdown(report))


@pytest.fixture(scope="module")
def measured_ceilings():
    return ceilings()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("L", CONTEXTS)
@pytest.mark.parametrize("T", TREE_SIZES)
def test_bench_attention(benchmark, measured_ceilings, T, L, H):
    q, caches, lens, mask = make_inputs(L, H, T)
    us = graph_time_us(lambda kv: mk.mla_attention(q, kv, lens, mask, SCALE), caches)
    cache_bytes, io_bytes, flops, roof_us = case_costs(L, H, T, 1, measured_ceilings)
    benchmark.extra_info.update({"graph_us": us, "cache_bytes": cache_bytes, "GBps": (cache_bytes + io_bytes) / us / 1e3,
                                 "frac_read_bw": (cache_bytes + io_bytes) / us / 1e3 / measured_ceilings["read_GBps"],
                                 "roofline_us": roof_us, "x_roofline": us / roof_us})
    kv = caches[0]
    benchmark(lambda: (mk.mla_attention(q, kv, lens, mask, SCALE), torch.cuda.synchronize()))


if __name__ == "__main__":
    sys.exit(main())
