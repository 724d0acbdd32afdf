"""The kernel tuner: sweeps each op's configs at K2.6 shapes per bucket, writes a tuned file the kernels load.

    python -m bench.tune [--ops moe,linear,attention,tree] [--arch sm_120] [--budget-s 600] --out FILE

Per bucket (MoE: TP8 and EP8 expert shapes x M buckets; linear: every projection shape x M bucket; attention: tree
sizes x contexts, and the merge per split count; tree: budgets, each of top-k, build and accept apart) the config in
force now (the shipped file's or the Python table's: "default") is measured first, then the candidates. Each
candidate is run once and checked against the torch reference (rel. error < 1e-2; the tree ops exactly) before it
is timed: a wrong one is rejected, one that does not compile, or (under the sm_120 proxy) whose sm_120 build needs
more than sm_120's shared memory or spills, is skipped with a one-line reason. Times: GPU time of a CUDA graph of
calls over rotating inputs (L2-cold weights and caches), median of replays. A bucket takes the fastest candidate
only where it beats the default by >= --margin after both are timed again; else it keeps the default (null).

The file (triton_kernels/tuning.py has its format) is written atomically after each bucket; a rerun with the same
--out skips the buckets done for the same arch, GPU and Triton. --budget-s bounds each op: no candidate starts past
a bucket's share of what is left (but the first of each MoE layout), no bucket past the whole (rerun to go on).
--shapes tiny: small shapes for tests (CPU, TRITON_INTERPRET=1, fp16). Take the file into use with
SPEC_KERNEL_CONFIGS=FILE (or copy it to triton_kernels/tuned/<arch>.json); README.md, "Tuning on your GPU".
"""

import argparse
import datetime
import functools
import json
import math
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import graph_us, rel_err

OPS = ("moe", "linear", "attention", "tree")
TOLERANCE = 1e-2  # relative error norm of a float output against the fp32 reference


def canonical(entry):
    return json.dumps(entry, sort_keys=True)


# ---- timing


def time_us(calls, reps):
    """Median microseconds per call of `calls` (thunks): GPU time of one CUDA graph of them on CUDA, the host clock
    elsewhere (the interpreter)."""
    if torch.cuda.is_available():
        return graph_us(calls, reps)
    times = []
    for _ in range(max(1, reps // 5)):
        start = time.perf_counter()
        for fn in calls:
            fn()
        times.append((time.perf_counter() - start) / len(calls))
    return 1e6 * statistics.median(times)


def device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def float_dtype():
    """bf16 on the GPU; fp16 under the interpreter (its bf16 tl.dot is wrong)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float16


def proxy(key):
    """Whether this GPU runs another arch's tables (the sm_120 proxy): candidates are then compile-checked for the
    arch itself."""
    from triton_kernels import arch

    return torch.cuda.is_available() and arch.device_arch() != key


# ---- MoE


class MoeTuner:
    """W4A16 MoE at the TP8 (384 experts, intermediate 256) and EP8 (48, 2048) ranks' shapes, top-8 routing,
    M buckets. TP8 buckets past M = 4 (the verify's trees) route as the verify step does, to as many distinct
    experts (bench.test_moe.step_pool); the rest uniformly. The swapped-tile forms run in both expert layouts
    (K-major or not); a shape's table takes the layout whose buckets' best times sum lower (`table`)."""

    op = "moe"
    BOUNDS = (1, 4, 16, 33, 128, None)  # plus the Python table's bounds
    LARGEST_M = 256  # the M timed for the unbounded bucket

    def __init__(self, key, tiny):
        from bench.test_moe import SHAPES, TOP_K

        from triton_kernels import moe_configs

        self.key, self.tiny = key, tiny
        self.shapes = {"tiny": dict(E=4, D=256, I=64)} if tiny else SHAPES
        self.top_k = 2 if tiny else TOP_K
        bounds = (2, None) if tiny else sorted({b for b in self.BOUNDS if b} |
                                               {b for b, _ in moe_configs.CONFIGS[key] if b}) + [None]
        self.bounds = bounds
        self.cases = {}

    def buckets(self):
        return [(f"{shape}/M{bound or 'max'}", dict(shape=shape, bound=bound))
                for shape in self.shapes for bound in self.bounds]

    def rows(self, info):
        bound = info["bound"]
        return bound if bound else (6 if self.tiny else self.LARGEST_M)

    def default(self, info):
        from triton_kernels import moe_configs

        return moe_configs.config_for(device(), self.rows(info), intermediate=self.shapes[info["shape"]]["I"])

    def candidates(self, info):
        """On another arch than sm_90 first sm_90's entry with mma.sync dots; the swapped-tile forms that need no
        Hopper-only feature (mma.sync) in both layouts; then the default's neighbours in its layout."""
        M, D = self.rows(info), self.shapes[info["shape"]]["D"]
        base = self.default(info)
        out = []

        def kernel(k, **changes):
            return {**k, **changes}

        def add(label, entry):
            out.append((label, dict(entry, kmajor=entry.get("kmajor", base["kmajor"]))))

        from triton_kernels import moe_configs

        if self.key != "sm_90":  # Hopper's entry, its dots on mma.sync: the same instructions another arch has
            hopper = moe_configs.with_overrides(moe_configs.table_entry("sm_90", M, self.shapes[info["shape"]]["I"]),
                                                moe_configs.MMA_V2)
            add("sm_90's entry", dict(hopper, kmajor=moe_configs.KMAJOR["sm_90"]))
        swap = dict(BN=64, num_warps=4, num_stages=3, swap=True, lop3=True, scales_ahead=True, mma_v2=True)
        bm = 8 if M <= 128 else 16
        tiles = 4 if D % 256 == 0 else 1
        for kmajor in (base["kmajor"], not base["kmajor"]):
            layout = " kmajor" if kmajor else ""
            for waves in (4, 2):
                add(f"swap BM{bm} waves{waves}{layout}", dict(BM=bm, decode=M <= 4, pdl=True, kmajor=kmajor,
                                                               gate_up=dict(swap, waves=waves),
                                                               down=dict(swap, waves=waves, tiles=tiles)))
            if M <= 4:
                add(f"swap decode maxnreg128{layout}", dict(BM=8, decode=True, pdl=True, kmajor=kmajor,
                                                             gate_up=dict(swap, waves=4, maxnreg=128),
                                                             down=dict(swap, waves=4, tiles=tiles)))
            if 5 <= M <= 33:
                add(f"swap device-split{layout}", dict(BM=8, pdl=True, kmajor=kmajor,
                                                       gate_up=dict(swap, waves=4, device_split=True),
                                                       down=dict(swap, waves=4, tiles=tiles, persistent=True)))
        g, d = base["gate_up"], base["down"]
        for name, k in (("gate_up", g), ("down", d)):
            for bn in (32, 64, 128):
                if bn != k["BN"] and not (name == "down" and D % (bn * k.get("tiles", 1))):
                    add(f"{name} BN{bn}", dict(base, **{name: kernel(k, BN=bn)}))
            for stages in (2, 3, 4):
                if stages != k["num_stages"]:
                    add(f"{name} stages{stages}", dict(base, **{name: kernel(k, num_stages=stages)}))
            add(f"{name} warps{12 - k['num_warps']}", dict(base, **{name: kernel(k, num_warps=12 - k["num_warps"])}))
            for waves in (k["waves"] * 2, k["waves"] / 2):
                add(f"{name} waves{waves:g}", dict(base, **{name: kernel(k, waves=waves)}))
        if M <= 16:
            add(f"decode {not base.get('decode', False)}", dict(base, decode=not base.get("decode", False)))
        add(f"pdl {not base.get('pdl', False)}", dict(base, pdl=not base.get("pdl", False)))
        add("BM16" if base["BM"] == 8 else "BM8 swap", dict(base, BM=16) if base["BM"] == 8 else
            dict(base, BM=8, gate_up=kernel(g, swap=True), down=kernel(d, swap=True)))
        return out

    def layers(self, shape):
        """({kmajor: the layers prepared in that layout}, the first one's checkpoint form, {M: calls}), built once
        per shape (the last shape's kept): enough layers that the calls of a graph find their experts cold in L2."""
        from ops.moe import PackedExperts
        from triton_kernels import moe_layout

        if shape not in self.cases:
            self.cases.clear()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            E, D, I = self.shapes[shape].values()
            dev = device()
            gen = torch.Generator(dev).manual_seed(0)
            if self.tiny:
                n_layers = 1
            else:
                from bench.test_moe import layers_needed

                n_layers = layers_needed(D, I)

            def words(n, k):
                w = torch.randint(-2**31, 2**31, (E, n, k // 8), generator=gen, device=dev, dtype=torch.int32)
                s = (torch.rand(E, n, k // 32, generator=gen, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
                return w, s

            raw = [PackedExperts(*words(2 * I, D), *words(D, I)) for _ in range(n_layers)]
            def prepared(layer, kmajor):
                return moe_layout.prepare_moe(layer.gate_up_packed, layer.gate_up_scale, layer.down_packed,
                                              layer.down_scale, kmajor=kmajor)

            self.cases[shape] = ({kmajor: [prepared(layer, kmajor) for layer in raw] for kmajor in (False, True)},
                                 raw[0], {})
        return self.cases[shape]

    def case(self, info):
        """(calls: (x, ids, weights) each, prepared layers, checkpoint layer) of a bucket."""
        shape, M = info["shape"], self.rows(info)
        layers, raw, by_m = self.layers(shape)
        if M in by_m:
            return by_m[M], layers, raw
        E, D, _ = self.shapes[shape].values()
        dev = device()
        gen = torch.Generator(dev).manual_seed(M)
        if self.tiny:
            n_calls = 2
        else:
            from bench.test_moe import CALLS as n_calls
            from bench.test_moe import step_pool
        pool = E if self.tiny or info["shape"] != "tp8" or M <= 4 else step_pool(M, E)
        calls = []
        for _ in range(n_calls):
            chosen = torch.randperm(E, generator=gen, device=dev)[:pool]
            ids = chosen[torch.rand(M, pool, generator=gen, device=dev).topk(self.top_k, dim=-1).indices].int()
            weights = torch.rand(M, self.top_k, generator=gen, device=dev)
            calls.append((torch.randn(M, D, generator=gen, device=dev).to(float_dtype()), ids, weights))
        by_m[M] = calls
        return calls, layers, raw

    def reference(self, info):
        from ops.moe import moe_torch

        calls, _, raw = self.case(info)
        x, ids, weights = calls[0]
        return moe_torch(x.float(), ids, weights, raw)

    def run(self, info, entry, reference):
        """(error or None, the timing thunks) of `entry`."""
        from triton_kernels import moe_w4a16

        calls, by_layout, _ = self.case(info)
        layers = by_layout[entry["kmajor"]]
        out = moe_w4a16.moe(*calls[0], layers[0], config=entry)
        err = rel_err(out, reference)
        thunks = [lambda c=c, j=j: moe_w4a16.moe(*c, layers[j % len(layers)], config=entry)
                  for j, c in enumerate(calls)]
        return (f"rel. error {err:.3g}" if not err < TOLERANCE else None), thunks

    def fit_key(self, info, entry):
        return canonical([info["shape"], entry])  # the kernels compile alike for every M

    def fit_specs(self, info, entry):
        from triton_kernels.moe_w4a16 import compile_specs

        shape = self.shapes[info["shape"]]
        return compile_specs(entry, key=self.key, D=shape["D"], I=shape["I"], top_k=self.top_k)

    def group(self, entry):
        """The layout an entry runs in: a shape's table keeps to one (`table`)."""
        return "kmajor" if entry["kmajor"] else "slab"

    def table(self, measured):
        """{intermediate: [[bound, entry or null], ...]} over every bucket of every shape: per shape the layout
        whose measured buckets' best times sum lower, among those timed in every measured bucket and no slower
        than the default in any (the default's always), and per bucket its fastest entry in that layout."""
        out = {}
        for shape in self.shapes:
            names = [(name, info) for name, info in self.buckets() if info["shape"] == shape]
            records = [measured.get(name) for name, _ in names]
            layout, _ = self.layout({name: r for (name, _), r in zip(names, records) if r})
            rows = out.setdefault(str(self.shapes[shape]["I"]), [])
            for (_, info), record in zip(names, records):
                rows.append([info["bound"], record["by_group"][layout]["entry"] if record and layout else None])
        return out

    @staticmethod
    def layout(records):
        """(layout, {layout left out: why}) of a shape's measured buckets {name: record}: `table`'s rule."""
        def left_out(g):
            for name, r in records.items():
                if g not in r["by_group"]:
                    return f"untimed in {name}"
                if r["default_group"] != g and r["by_group"][g]["us"] > r["default_us"]:
                    return f"slower than the default in {name}"
            return None

        why = {g: reason for g in ("slab", "kmajor") if (reason := left_out(g))}
        fits = [g for g in ("slab", "kmajor") if g not in why]
        chosen = min(fits, key=lambda g: sum(r["by_group"][g]["us"] for r in records.values())) if fits else None
        return chosen, why

    def notes(self, measured):
        """One line a shape: the layout its table keeps, and why the other was left out."""
        lines = []
        for shape in self.shapes:
            layout, why = self.layout({name: measured[name] for name, info in self.buckets()
                                       if info["shape"] == shape and name in measured})
            left_out = "; ".join(f"{g}: {reason}" for g, reason in why.items())
            kept = (f"the {layout} layout, each bucket its fastest entry there" if layout else
                    "the Python table (no layout fits)")
            lines.append(f"moe {shape}: the table keeps {kept}" + (f"; left out: {left_out}" if left_out else ""))
        return lines


# ---- dense projections


class LinearTuner:
    """Skinny GEMM vs cuBLAS at every projection shape of a TP8 rank and its drafter, per M bucket."""

    op = "linear"
    GEMV = [("gemv", 8, 512, 4, 4, 1), ("gemv", 16, 256, 4, 6, 1), ("gemv", 32, 256, 4, 3, 2),
            ("gemv", 16, 512, 4, 4, 1), ("gemv", 8, 1024, 4, 3, 1), ("gemv", 32, 256, 4, 3, 2, True)]
    DOT = [("swap", 64, 128, 4, 4, 1), ("swap", 64, 128, 4, 4, 2), ("swap", 64, 256, 4, 3, 1, False, True),
           ("swap", 128, 128, 4, 3, 2), ("dot", 32, 128, 4, 4, 1), ("dot", 32, 128, 4, 4, 2),
           ("dot", 32, 128, 4, 4, 1, False, True), ("dot", 64, 128, 4, 4, 1, False, True),
           ("swap", 64, 256, 4, 3, 2)]

    def __init__(self, key, tiny):
        from triton_kernels import linear

        self.key, self.tiny = key, tiny
        if tiny:
            self.shapes, self.ms = [(64, 256)], (1, 2)
        else:
            from bench.test_dense import SHAPES

            self.shapes, self.ms = list(SHAPES), linear.BUCKETS
        self.cases = {}

    def buckets(self):
        return [(f"{N}x{K}/M{M}", dict(N=N, K=K, M=M)) for N, K in self.shapes for M in self.ms]

    def default(self, info):
        from triton_kernels import linear

        cfg = linear.adopted(device(), info["M"], info["N"], info["K"])
        return cfg._asdict() if cfg else "cublas"

    def candidates(self, info):
        """cuBLAS; on another arch than sm_90 first sm_90's adopted entry for the bucket (its TMA tiles need no
        multicast or clusters); then the kernel's forms for the M."""
        from triton_kernels.linear import ADOPTED, Config, bucket_of

        forms = self.GEMV if info["M"] == 1 else self.DOT
        hopper = ADOPTED["sm_90"].get((info["N"], info["K"]), {}).get(bucket_of(info["M"]))
        if self.key != "sm_90" and hopper:
            forms = [tuple(hopper), *(form for form in forms if Config(*form) != hopper)]
        out = [("cublas", "cublas")]
        for form in forms:
            cfg = Config(*form)
            out.append((" ".join(str(v) for v in form), cfg._asdict()))
        return out

    def case(self, info):
        N, K, M = info["N"], info["K"], info["M"]
        if (N, K) not in self.cases:
            self.cases.clear()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            gen = torch.Generator(device()).manual_seed(0)
            if self.tiny:
                copies = 1
            else:
                from bench.test_dense import MIN_CALLS, ROTATE_BYTES

                copies = max(MIN_CALLS, math.ceil(ROTATE_BYTES / (N * K * 2)))
            self.cases[N, K] = [torch.randn(N, K, generator=gen, device=device()).to(float_dtype()) / K ** 0.5
                                for _ in range(copies)]
        weights = self.cases[N, K]
        x = torch.randn(M, K, generator=torch.Generator(device()).manual_seed(M), device=device()).to(float_dtype())
        return x, weights

    def reference(self, info):
        x, weights = self.case(info)
        return x.float() @ weights[0].float().T

    def run(self, info, entry, reference):
        import torch.nn.functional as F

        from triton_kernels import linear

        x, weights = self.case(info)
        if entry == "cublas":
            fn = F.linear if torch.cuda.is_available() else lambda x, w: (x.float() @ w.float().T).to(x.dtype)
        else:
            cfg = linear.Config(**entry)

            def fn(x, w):
                return linear.linear_kernel(x, w, cfg)

        err = rel_err(fn(x, weights[0]), reference)
        thunks = [lambda w=w: fn(x, w) for w in weights]
        return (f"rel. error {err:.3g}" if not err < TOLERANCE else None), thunks

    def fit_key(self, info, entry):
        return None

    def fit_specs(self, info, entry):
        """None to check: `linear.plan` holds the stages within the arch's shared memory (SHARED_BUDGET)."""
        return []

    def table(self, measured):
        out = {}
        for name, info in self.buckets():
            record = measured.get(name)
            if record and record["entry"] is not None:
                out.setdefault(f"{info['N']}x{info['K']}", {})[str(info["M"])] = record["entry"]
        return out


# ---- attention


class AttentionTuner:
    """MLA tree attention at one TP8 rank (8 heads): trees of T nodes x contexts (tiles, split count, tail split,
    partials), and the merge of the splits' partials per split count."""

    op = "attention"
    HEADS = 8
    TREES = (1, 9, 33, 65, 129)  # T: the verify step's trees (budget + 1)
    CONTEXTS = ((4096, 6144), (32768, 49152), (131072, None))  # (cache entries timed, the bucket's bound)
    MERGE_SPLITS = (8, 16, 32, 64, 128)

    def __init__(self, key, tiny):
        self.key, self.tiny = key, tiny
        if tiny:
            self.trees, self.contexts, self.merge_splits = (2,), ((96, None),), (4,)
        else:
            self.trees, self.contexts, self.merge_splits = self.TREES, self.CONTEXTS, self.MERGE_SPLITS
        self.cases = {}

    def buckets(self):
        split = [(f"T{T}/L{L}", dict(kind="split", T=T, L=L, bound=bound))
                 for T in self.trees for L, bound in self.contexts]
        split.sort(key=lambda bucket: bucket[1]["bound"] is None)  # the longest context, the slowest to time, last
        return split + [(f"merge/S{S}", dict(kind="merge", S=S)) for S in self.merge_splits]

    def case(self, info):
        from ops.attention import pack_tree_mask

        name = canonical(info)
        if name in self.cases:
            return self.cases[name]
        self.cases.clear()
        dev, dtype, H = device(), float_dtype(), self.HEADS
        gen = torch.Generator(dev).manual_seed(0)
        if info["kind"] == "merge":
            T = 2 if self.tiny else 33
            rows = T * H
            o = torch.randn(1, info["S"], rows, 512, generator=gen, device=dev).to(dtype)
            lse = torch.randn(1, info["S"], rows, generator=gen, device=dev) * 4
            lse[0, -1, ::3] = float("-inf")  # empty splits
            self.cases[name] = (o, lse, torch.zeros(1, T, H, 512, dtype=dtype, device=dev))
            return self.cases[name]
        T, L = info["T"], info["L"]
        from bench.test_attention import ROTATE_BYTES

        rotate = 1 if self.tiny else min(64, max(2, math.ceil(ROTATE_BYTES / (L * 576 * 2))))
        caches = [torch.randn(1, L, 576, generator=gen, device=dev).to(dtype) for _ in range(rotate)]
        q = torch.randn(1, T, H, 576, generator=gen, device=dev).to(dtype)
        parents = [-1] + [int(torch.randint(t, (1,), generator=torch.Generator().manual_seed(t))) for t in range(1, T)]
        dense = torch.zeros(1, T, T, dtype=torch.bool)
        for t in range(T):
            n = t
            while n >= 0:
                dense[0, t, n], n = True, parents[n]
        mask = pack_tree_mask(dense).to(dev)
        lens = torch.full((1,), L, dtype=torch.int32, device=dev)
        self.cases[name] = (q, caches, lens, mask)
        return self.cases[name]

    # Two-pass tiles beside the table's (mla_two_pass.TwoPassTiles): the runners-up of
    # bench/results/attention_two_pass_h100.md.
    TWO_PASS_FORMS = ((64, 64, 4, 4, 32, 256, 4, 3), (32, 64, 4, 4, 32, 256, 4, 3), (128, 64, 4, 3, 64, 128, 4, 3),
                      (128, 64, 4, 3, 32, 128, 4, 3), (64, 128, 4, 3, 64, 64, 4, 3))

    def plan(self, info, config=None):
        """The attention's plan in force for a split bucket, at its timed context (config: a call's choices)."""
        from triton_kernels import mla_attention

        q = torch.empty(1, info["T"], self.HEADS, 576, dtype=float_dtype(), device=device())
        return mla_attention.plan(q, torch.empty(1, info["L"], 576, dtype=q.dtype, device=q.device), False, config)

    def default(self, info):
        """The choices in force, in the file's form (the merge: its blocks). The split count stays None (the split
        model's, per cache length) unless the file in force pins it: a bucket spans many lengths."""
        from triton_kernels import mla_attention, tuning

        if info["kind"] == "merge":
            return list(mla_attention.merge_blocks(info["S"], self.key))
        tuned = tuning.attention_entry(self.key, info["T"] * self.HEADS, info["L"]) or {}
        p = self.plan(info)
        if p.two_pass:  # the file's split count where its entry is a two-pass one
            pinned = tuned.get("splits") if tuned.get("two_pass") else None
            return dict(two_pass=list(p.two_pass), splits=pinned, partials=self._partials(p))
        return self._split_kernel(p, tuned.get("splits"))

    def _partials(self, p):
        return "fp32" if p.partials == torch.float32 and float_dtype() != torch.float32 else "q"

    def _split_kernel(self, p, splits):
        """A split-kernel entry with plan p's choices (two_pass false where the arch has the two-pass kernels, so
        that the entry keeps the split kernel at any row count)."""
        from triton_kernels import mla_attention

        entry = dict(tiles=list(p.entry.tiles), splits=splits, tail_split=p.tail_split, partials=self._partials(p),
                     tma=p.tma)
        return dict(entry, two_pass=False) if mla_attention.TWO_PASS[self.key] else entry

    def candidates(self, info):
        base = self.default(info)
        if info["kind"] == "merge":
            S = info["S"]
            forms = {(min(S, 16), 512, 2), (S, 64, 2), (S, 128, 4), (min(S, 32), 256, 4), (min(S, 8), 512, 4)}
            return [(f"{bs}x{bd} warps{w}", [bs, bd, w]) for bs, bd, w in sorted(forms) if [bs, bd, w] != base]
        from triton_kernels import mla_attention

        out = []
        s = base["splits"] or self.plan(info).splits
        for splits in sorted({max(1, s // 2), s * 2, max(1, s * 3 // 4), s * 3 // 2} - {s}):
            out.append((f"splits{splits}", dict(base, splits=splits)))
        table = mla_attention.TWO_PASS[self.key]
        if table and info["T"] * self.HEADS > 16:
            forms = {table[1], *self.TWO_PASS_FORMS} - {tuple(base.get("two_pass") or ())}
            out += [("two-pass " + "x".join(map(str, t)), dict(two_pass=list(t), splits=None,
                                                                partials=base["partials"])) for t in sorted(forms)]
        if base.get("two_pass"):  # the split kernel's own default and tile forms
            split_plan = self.plan(info, mla_attention.Config(two_pass=False))
            base = self._split_kernel(split_plan, None)
            out.append(("split kernel", base))
            s = split_plan.splits
        if s > 1:
            out.append((f"tail {not base['tail_split']}", dict(base, tail_split=not base["tail_split"])))
            if float_dtype() != torch.float32:
                other = "q" if base["partials"] == "fp32" else "fp32"
                out.append((f"partials {other}", dict(base, partials=other)))
        tiles = {tuple(e.tiles) for e in mla_attention.CONFIGS[self.key]} | {
            (16, 64, 4, 2, False), (32, 32, 4, 2, False), (16, 32, 4, 3, False), (32, 64, 8, 2, False),
            (64, 16, 8, 2, False),  # 64 rows a tile: a tree's rows re-read the cache half as often as at 32
            (32, 16, 8, 2, False),  # the default's rows, half its KV tile: 58 KB
            (16, 16, 4, 2, False)}  # 38 KB and 128 registers a thread: two programs an SM on sm_120
        for t in sorted(tiles - {tuple(base["tiles"])}):
            if t[0] <= 16 or info["T"] * self.HEADS > 16:
                out.append((f"tiles {t[0]}x{t[1]} w{t[2]} s{t[3]}", dict(base, tiles=list(t), splits=None)))
        return out

    def reference(self, info):
        if info["kind"] == "merge":
            o, lse, out = self.case(info)
            w = torch.exp2(lse - lse.amax(1, keepdim=True))  # [1, S, rows]
            merged = (w[..., None] * o.float().nan_to_num()).sum(1) / w.sum(1)[..., None]
            return merged.view(out.shape)
        from ops.attention import mla_attention_torch

        q, caches, lens, mask = self.case(info)
        return mla_attention_torch(q.float(), caches[0].float(), lens, mask, 0.1)

    def run(self, info, entry, reference):
        from triton_kernels import mla_attention, tuning

        if info["kind"] == "merge":
            o, lse, out = self.case(info)
            rows = out.shape[1] * out.shape[2]

            def merge():
                with tuning.overriding(self.key, {"attention": {"merge": {str(info["S"]): entry}}}):
                    return mla_attention._merged(o, lse, out, rows, info["S"], 1, False, o)

            err = rel_err(merge(), reference)
            return (f"rel. error {err:.3g}" if not err < TOLERANCE else None), [merge] * 8
        q, caches, lens, mask = self.case(info)
        tables = {"attention": {"splits": [[None, None, entry]]}}

        def call(kv):
            with tuning.overriding(self.key, tables):
                return mla_attention.mla_attention(q, kv, lens, mask, 0.1)

        err = rel_err(call(caches[0]), reference)
        return (f"rel. error {err:.3g}" if not err < TOLERANCE else None), [lambda kv=kv: call(kv) for kv in caches]

    def fit_key(self, info, entry):
        if info["kind"] == "merge":
            return None
        if entry.get("two_pass"):
            return canonical(["two-pass", entry["two_pass"], entry["partials"]])
        return canonical([info["T"] * self.HEADS <= 16, entry["tiles"], entry.get("tma"), entry["partials"]])

    def fit_specs(self, info, entry):
        from triton_kernels import mla_attention, mla_two_pass

        if info["kind"] == "merge":
            return []
        if entry.get("two_pass"):
            return mla_two_pass.kernel_specs(mla_two_pass.TwoPassTiles(*entry["two_pass"]), self.key, H=self.HEADS,
                                             partials="fp32" if entry["partials"] == "fp32" else "bf16")
        base = mla_attention.entry_for(info["T"] * self.HEADS, self.key)
        entry_tiles = mla_attention.Tiles(*entry["tiles"])
        return [mla_attention.split_kernel_spec(base._replace(tiles=entry_tiles, tma=bool(entry.get("tma"))),
                                                self.key, causal=False, H=self.HEADS,
                                                partials="fp32" if entry["partials"] == "fp32" else "bf16")]

    def table(self, measured):
        splits, merge = [], {}
        for name, info in self.buckets():
            record = measured.get(name)
            entry = record["entry"] if record else None
            if info["kind"] == "merge":
                if entry is not None:
                    merge[str(info["S"])] = entry
            else:
                splits.append([info["T"] * self.HEADS, info["bound"], entry])
        return {"splits": splits, "merge": merge}


# ---- DDTree


class TreeTuner:
    """DDTree's top-k, tree build and accept (greedy) at batch 1, V = 163840, 15 drafter depths, per budget; each op
    tuned apart (its fields of the config), the bucket's entry their winners together."""

    op = "tree"
    BUDGETS = (8, 16, 32, 64, 128, 256, 512)
    PIECES = ("topk", "build", "accept")

    def __init__(self, key, tiny):
        from bench.test_tree import BLOCKS, V

        self.key, self.tiny = key, tiny
        self.budgets = (4, 8) if tiny else self.BUDGETS
        self.V = 512 if tiny else V
        self.depths = 3 if tiny else BLOCKS[-1] - 1
        self.cases = {}

    def buckets(self):
        return [(f"B{b}/{piece}", dict(budget=b, piece=piece)) for b in self.budgets for piece in self.PIECES]

    def default(self, info):
        from triton_kernels import ddtree

        return ddtree.config_for(device(), info["budget"])

    def candidates(self, info):
        base = self.default(info)
        out = []
        if info["piece"] == "topk":
            for chunk in (2048, 4096, 8192):
                for warps in (4, 8, 16):
                    rows = [[512, chunk, warps, 4096, None]]
                    if rows != [list(r) for r in base["topk"]]:
                        out.append((f"chunk{chunk} warps{warps}", dict(base, topk=rows)))
        elif info["piece"] == "build":
            b = info["budget"]
            for warps in (1, 2, 4):
                out.append((f"heap warps{warps}", dict(base, levels_from=513, build_warps=warps)))
            for warps in (2, 4, 8):
                out.append((f"levels warps{warps}", dict(base, levels_from=b, levels_warps=warps)))
        else:
            for block in (1024, 2048, 4096):
                for warps in (4, 8):
                    for per_sm in (4, 8):
                        out.append((f"block{block} warps{warps} per_sm{per_sm}",
                                    dict(base, block_v=block, warps_v=warps, programs_per_sm=per_sm)))
            out.append(("maxnreg 48" if base["maxnreg_v"] is None else "no maxnreg",
                        dict(base, maxnreg_v=48 if base["maxnreg_v"] is None else None)))
            unroll = 4 if base["unroll_v"] == 2 else 2
            out.append((f"unroll {unroll}", dict(base, unroll_v=unroll)))
        return [(label, entry) for label, entry in out if canonical(entry) != canonical(base)]

    def case(self, info):
        """(draft logits, top-k out, root, tree, target logits) of a budget, built with the torch reference."""
        import ops

        b = info["budget"]
        if b in self.cases:
            return self.cases[b]
        self.cases.clear()
        dev = device()
        g = torch.Generator(dev).manual_seed(0)
        draft = (torch.randn(1, self.depths, self.V, generator=g, device=dev) * 3).to(float_dtype())
        root = torch.tensor([7], device=dev)
        with ops.using(draft_topk="torch", tree_build="torch"):
            lp, tok = ops.draft_topk(draft, b)
            tree = ops.build_tree(lp, tok, root, b)
        logits = torch.randn(1, b + 1, self.V, generator=g, device=dev) * 3
        fc = tree.first_child[0].long()
        rows = torch.nonzero(fc >= 0).flatten()
        logits[0, rows, tree.tokens[0, fc[rows]]] = 30.0  # long accepted paths
        self.cases[b] = (draft, lp, tok, root, tree, logits.to(float_dtype()))
        return self.cases[b]

    def thunk(self, info, backend):
        import ops

        draft, lp, tok, root, tree, logits = self.case(info)
        b, piece = info["budget"], info["piece"]
        op = dict(topk="draft_topk", build="tree_build", accept="accept")[piece]

        def call():
            with ops.using(**{op: backend}):
                if piece == "topk":
                    return ops.draft_topk(draft, b)
                if piece == "build":
                    return tuple(vars(ops.build_tree(lp, tok, root, b)).values())
                return ops.accept(tree, logits, 0.0)

        return call

    def reference(self, info):
        return self.thunk(info, "torch")()

    def run(self, info, entry, reference):
        from bench.test_tree import equal
        from triton_kernels import tuning

        call = self.thunk(info, "triton")

        def tuned():
            with tuning.overriding(self.key, {"tree": [[None, entry]]}):
                return call()

        got = tuned()
        if info["piece"] == "topk":
            ok = torch.equal(got[1], reference[1]) and (got[0] - reference[0]).abs().max().item() < 1e-5
        else:
            ok = equal(got, reference)
        return (None if ok else "outputs differ from the reference"), [tuned] * 8

    def fit_key(self, info, entry):
        return None  # compile failures show at the first launch

    def fit_specs(self, info, entry):
        return []

    def table(self, measured):
        """[[budget, entry or null], ...]: per budget the default with each piece's winner's fields."""
        from triton_kernels import ddtree

        fields = dict(topk=("topk",), build=("build_warps", "levels_from", "levels_warps"),
                      accept=("block_v", "warps_v", "maxnreg_v", "programs_per_sm", "unroll_v"))
        out = []
        for b in self.budgets:
            entry = None
            for piece in self.PIECES:
                record = measured.get(f"B{b}/{piece}")
                if record and record["entry"] is not None:
                    entry = entry or {k: (list(map(list, v)) if k == "topk" else v)
                                      for k, v in ddtree.CONFIGS[self.key].items()}
                    entry.update({k: record["entry"][k] for k in fields[piece]})
            out.append([b, entry])
        return out


TUNERS = dict(moe=MoeTuner, linear=LinearTuner, attention=AttentionTuner, tree=TreeTuner)


# ---- the compile check under the proxy


@functools.cache
def worker_tuner(op, key, tiny):
    return TUNERS[op](key, tiny)


def fit_reason(op, key, info, entry, tiny):
    """Why `entry` cannot run on `key` (its build for `key` needs more than its shared memory, spills, or does not
    compile), or None. Runs in a worker process."""
    from triton_kernels import arch
    from triton_kernels.aot import compile_for

    try:
        for kernel, signature, constexprs, options in worker_tuner(op, key, tiny).fit_specs(info, entry):
            res = compile_for(kernel, signature, constexprs, **options)
            if res.shared > arch.shared_limit(key):
                return f"{kernel.__name__} needs {res.shared} B of shared memory > {arch.shared_limit(key)}"
            if res.spill_bytes:
                return f"{kernel.__name__} spills {res.spill_bytes} B"
    except Exception as err:  # a candidate that does not compile is skipped, with the reason
        return f"does not compile for {key}: {one_line(err)}"
    return None


def one_line(err):
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:160] if text else type(err).__name__


# ---- the sweep


def header(key, command):
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(arch=key, gpu=gpu, triton=triton.__version__, torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), command=command)


SAME_RUN = ("arch", "gpu", "triton")  # a file's buckets are reused by a run with the same of these


def resume(path, head):
    """The file an earlier run wrote to `path` for the same arch: its tables and, where it ran on the same GPU and
    Triton, its measured buckets ({} otherwise). Tables measured elsewhere are kept for the ops not tuned now, and
    the header says where they come from."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        old = data["header"]
    except (OSError, ValueError, KeyError, TypeError):
        print(f"note: {path} is not a tuned file: starting afresh", file=sys.stderr)
        return {}
    if old.get("arch") != head["arch"]:
        print(f"note: {path} holds {old.get('arch')}'s tables: starting afresh", file=sys.stderr)
        return {}
    carried = old.get("carried", {})  # op -> where its table was tuned, where not on this GPU
    if any(old.get(k) != head[k] for k in SAME_RUN):
        where = ", ".join(str(old.get(k)) for k in ("gpu", "triton", "date"))
        print(f"note: {path} was tuned on {where}: its buckets are measured again", file=sys.stderr)
        data = {op: data[op] for op in OPS if op in data}
        carried = {op: carried.get(op, where) for op in data}
    return dict(data, carried=carried)


def write(path, head, tuners, measured, earlier):
    """The tuned file from the measured buckets (the earlier file's tables of the ops not tuned now), written
    atomically."""
    from triton_kernels import tuning

    data = dict(format=tuning.FORMAT, header=head)
    carried = {}
    for op in OPS:
        if op in tuners and measured.get(op):
            data[op] = tuners[op].table(measured[op])
        elif op not in tuners and earlier.get(op) is not None:
            data[op] = earlier[op]
            if op in earlier.get("carried", {}):
                carried[op] = earlier["carried"][op]
    if carried:
        data["header"] = dict(head, carried=carried)
    data["measured"] = measured
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def measure(tuner, name, info, end, left, reps, margin, fits, bar):
    """One bucket: the default, then the candidates within its share of the time to `end` (shared with the `left`
    - 1 buckets after it, from when the default is timed: a shape's first bucket also builds its case); the winner
    re-timed against the default. Where the tuner groups entries (`tuner.group`: a table keeps to one group), each
    group's first candidate starts past the share too, so that every group has a time in every bucket. Returns its
    record, or None where the default does not run. The record's entry is the winner's, the default's included, so
    a rerun over a tuned file in force keeps the entries that still win."""
    reference = tuner.reference(info)
    default = tuner.default(info)
    seen = {canonical(default)}
    timed, notes = {}, {}
    thunks = {}
    deadline = None
    grouped = hasattr(tuner, "group")
    for label, entry in [("default", default)] + tuner.candidates(info):
        if label != "default":
            if canonical(entry) in seen:
                continue
            if deadline is None:
                now = time.monotonic()
                deadline = now + max(0.0, end - now) / left
            first_of_group = grouped and all(tuner.group(e) != tuner.group(entry) for e, _ in thunks.values())
            if time.monotonic() >= deadline and not first_of_group:
                notes[label] = "not started: budget spent"
                continue
        seen.add(canonical(entry))
        bar.set_postfix_str(f"{tuner.op} {name} {label}"[:70])
        fit = fits.get(tuner.fit_key(info, entry))
        reason = fit.result() if fit is not None else None
        if reason:
            notes[label] = f"skipped: {reason}"
            tqdm.write(f"  {tuner.op} {name} {label}: skipped: {reason}")
            continue
        try:
            wrong, calls = tuner.run(info, entry, reference)
            if wrong:
                notes[label] = f"rejected: {wrong}"
                tqdm.write(f"  {tuner.op} {name} {label}: rejected: {wrong}")
                continue
            timed[label] = time_us(calls, reps)
            thunks[label] = (entry, calls)
        except Exception as err:  # a candidate that does not compile or launch is skipped
            notes[label] = f"skipped: {one_line(err)}"
            tqdm.write(f"  {tuner.op} {name} {label}: skipped: {one_line(err)}")
    if "default" not in timed:
        tqdm.write(f"  {tuner.op} {name}: the default does not run ({notes.get('default')}); left out")
        return None
    best = min(timed, key=timed.get)
    default_us, best_us = timed["default"], timed[best]
    by_group = {}
    if hasattr(tuner, "group"):  # per group, its fastest: `tuner.table` may keep to one group
        for label in sorted(timed, key=timed.get):
            by_group.setdefault(tuner.group(thunks[label][0]), dict(label=label, us=round(timed[label], 3),
                                                                    entry=thunks[label][0]))
    if best != "default":  # both again, alternating: the winner must hold its lead
        again = {label: [] for label in ("default", best)}
        for _ in range(3):
            for label in again:
                again[label].append(time_us(thunks[label][1], reps))
        default_us, best_us = (statistics.median(again[label]) for label in ("default", best))
        if best_us > default_us * (1 - margin):
            best, best_us = "default", default_us
    record = dict(default_us=round(default_us, 3), best_us=round(best_us, 3), chosen=best, entry=thunks[best][0],
                  candidates={**{k: round(v, 3) for k, v in timed.items()}, **notes})
    if by_group:  # the default's group keeps the default unless its best beats it by the margin too
        home = by_group.get(tuner.group(default))
        if home and home["label"] != "default" and home["us"] > timed["default"] * (1 - margin):
            by_group[tuner.group(default)] = dict(label="default", us=round(timed["default"], 3), entry=default)
        by_group[tuner.group(thunks[best][0])] = dict(label=best, us=round(best_us, 3), entry=thunks[best][0])
        record.update(by_group=by_group, default_group=tuner.group(default))
    return record


def tune_op(tuner, measured, deadline_s, reps, margin, save):
    """Every bucket of `tuner` not in `measured`, within deadline_s seconds; `save()` after each."""
    buckets = [(name, info) for name, info in tuner.buckets() if name not in measured]
    start = time.monotonic()
    fits = {}
    if buckets and proxy(tuner.key):
        import multiprocessing

        pool = ProcessPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2) - 1)),
                                   mp_context=multiprocessing.get_context("spawn"))
        for _, info in buckets:
            for _, entry in [("default", tuner.default(info))] + tuner.candidates(info):
                key = tuner.fit_key(info, entry)
                if key is not None and key not in fits:
                    fits[key] = pool.submit(fit_reason, tuner.op, tuner.key, info, entry, tuner.tiny)
    else:
        pool = None
    bar = tqdm(buckets, desc=tuner.op, unit="bucket", file=sys.stderr, dynamic_ncols=True)
    try:
        for i, (name, info) in enumerate(bar):
            if time.monotonic() - start > deadline_s:
                tqdm.write(f"  {tuner.op}: --budget-s {deadline_s:g} spent; {len(buckets) - i} buckets left for a "
                           f"rerun")
                break
            record = measure(tuner, name, info, start + deadline_s, len(buckets) - i, reps, margin, fits, bar)
            if record is not None:
                measured[name] = record
                save()
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def summary(measured):
    lines = [f"{'op':<10}{'bucket':<24}{'default us':>12}{'best us':>10}{'speed-up':>10}  chosen"]
    for op, buckets in measured.items():
        for name, r in buckets.items():
            lines.append(f"{op:<10}{name:<24}{r['default_us']:>12.2f}{r['best_us']:>10.2f}"
                         f"{r['default_us'] / r['best_us']:>9.3f}x  {r['chosen']}")
    return "\n".join(lines)


def parse_ops(text):
    chosen = [op.strip() for op in text.split(",") if op.strip()]
    bad = [op for op in chosen if op not in OPS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"unknown op {', '.join(bad) or repr(text)}; the ops are {', '.join(OPS)}")
    return chosen


def parser():
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=parse_ops, default=list(OPS), help="comma-separated: " + ", ".join(OPS))
    p.add_argument("--arch", help="the tables to tune (as SPEC_ARCH; default: the arch in force on this GPU)")
    p.add_argument("--out", type=Path, required=True, help="the tuned file (JSON); rerun with it to resume")
    p.add_argument("--budget-s", type=float, default=600.0, help="seconds per op at most (default 600)")
    p.add_argument("--margin", type=float, default=0.02, help="a candidate replaces the default where it is this "
                                                               "much faster, re-timed (default 0.02)")
    p.add_argument("--reps", type=int, default=10, help="graph replays a timing takes the median of")
    p.add_argument("--fresh", action="store_true", help="measure every bucket of the ops named again, not only "
                                                         "those the --out file lacks (its other ops' tables kept)")
    p.add_argument("--shapes", choices=("k26", "tiny"), default="k26", help="tiny: small shapes, for the tests")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    from triton_kernels import arch, tuning

    if args.arch:
        try:
            arch.use(args.arch)
        except ValueError as err:
            print(f"error: --arch: {err}", file=sys.stderr)
            return 2
    if not args.out.parent.is_dir():
        print(f"error: --out {args.out}: no folder {args.out.parent}", file=sys.stderr)
        return 2
    key = arch.current()
    tuning.tables(key)  # the configs in force (the defaults measured), announced; a bad file ends here
    command = "python -m bench.tune " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    head = header(key, command)
    earlier = resume(args.out, head)
    measured = earlier.get("measured", {})
    tuners = {op: TUNERS[op](key, args.shapes == "tiny") for op in args.ops}
    for op, tuner in tuners.items():
        if args.fresh:
            measured[op] = {}
        measured.setdefault(op, {})
        tune_op(tuner, measured[op], args.budget_s, args.reps, args.margin,
                lambda: write(args.out, head, tuners, measured, earlier))
    write(args.out, head, tuners, measured, earlier)
    print(summary({op: measured[op] for op in args.ops}))
    for op, tuner in tuners.items():
        for line in tuner.notes(measured[op]) if hasattr(tuner, "notes") else ():
            print(line)
    print(f"wrote {args.out}: use it with SPEC_KERNEL_CONFIGS={args.out} (or copy it to "
          f"triton_kernels/tuned/{key}.json)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:  # a bad tuned file in force
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
