"""The dense projections of one K2.6 TP8 rank (and its drafter): cuBLAS (F.linear) against the Triton skinny GEMM.

`python bench/bench_linear.py --out DIR [--budget S] [--defaults] [--step-ab]`. Shapes are read off the model and
drafter built on the meta device (every weight that goes through `ops.linear` or `ops.mlp`); M in {1, 2, 4, 9,
17, 33, 65}. Weights are cold in L2: each call reads its own copy, rotating through >= 256 MiB of copies, all calls of a
point captured back to back in one CUDA graph and timed as a replay (median of 10, CUDA events) per call.
%BW = weight bytes / time / the read bandwidth measured in the same run (a sum over 4 GiB). Without --defaults
every Triton candidate of `candidates(M)` is timed and the fastest is proposed for `linear.ADOPTED` where it beats
cuBLAS by at least `MARGIN`; with --defaults only `ops.linear`'s current choice is timed beside cuBLAS. Then one
MoE layer's projections as a chain, and with --step-ab the TP8 rank's verify (cuBLAS against the table). Writes
linear.json and linear.md (the tables, and the proposed ADOPTED entries as Python).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import hbm_read_bandwidth, time_graph  # noqa: E402
from triton_kernels import linear as lk  # noqa: E402

MS = (1, 33, 9, 17, 65, 2, 4)  # timing order: the step's buckets first, so a cut-off run keeps them
ROTATE_BYTES = 256 * 2**20
MIN_CALLS = 8
MARGIN = 0.98  # adopt Triton where its time <= MARGIN x cuBLAS's (run-to-run noise is about 1-2%)


def shapes():
    """{(N, K): [names]} of the projections one TP8 rank of K2.6 and its drafter run through ops.linear."""
    from bench_step import drafter_config
    from model.config import preset
    from model.model import KimiModel
    from model.parallel import Parallel
    from spec.drafter import DFlashDrafter

    target = KimiModel(preset("kimi-k2.6"), Parallel(8, 0), torch.bfloat16, "meta")
    drafter = DFlashDrafter(drafter_config(target.cfg), torch.bfloat16, "meta", target.par)
    attn, dense, moe, layer = target.layers[1].self_attn, target.layers[0].mlp, target.layers[1].mlp, drafter.layers[0]
    named = [("q_a+kv_a", attn.down_proj_weight), ("q_b", attn.q_b_proj.weight), ("o_proj", attn.o_proj.weight),
             ("shared gate_up", moe.shared_experts.gate_up.weight),
             ("shared down", moe.shared_experts.down_proj.weight),
             ("dense gate_up", dense.gate_up.weight), ("dense down", dense.down_proj.weight),
             ("lm_head", target.lm_head.weight), ("draft q", layer.self_attn.q_proj.weight),
             ("draft k/v", layer.self_attn.k_proj.weight), ("draft o", layer.self_attn.o_proj.weight),
             ("draft gate_up", layer.mlp.gate_up.weight), ("draft down", layer.mlp.down_proj.weight),
             ("draft fc", drafter.fc.weight)]
    out = {}
    for name, w in named:
        out.setdefault(tuple(w.shape), []).append(name)
    return out


def candidates(M):
    """Triton configs timed at M rows (compile cost: one per kernel, tile, warps, stages, BLOCK_M and EVEN_K).
    M = 1: the gemv at 32-row tiles split over K (the adopted entries), and narrower tiles (8, 16 rows) with longer K
    tiles (512, 1024), deeper pipelines and 8 warps, whose K splits aim at one program per SM (x1; no split where
    the N tiles already fill the GPU). Measured slower and removed: a bulk prefetch of each program's whole weight
    range before its PDL wait (bench/results/linear_h200_s6.md); swap and dot at M = 1 (linear_h200.md). The `pdl`
    flag is not a candidate: on sm_90 every launch is on the PDL chain (`pdl.active`), so it compiles the same.
    M > 1: swap and dot tiles through pointers and through tensor descriptors (`tma`: the padding rows past M
    are not loaded; bench/results/linear_probe_h200_s11.json); x4 waves never won (linear_h200.md) and went."""
    C = lk.Config
    if M == 1:
        return [C("gemv", 32, 256, 4, 3, 2), C("gemv", 32, 256, 4, 3, 8), C("gemv", 32, 256, 4, 5, 2),
                C("gemv", 32, 256, 8, 4, 1), C("gemv", 32, 512, 8, 3, 1), C("gemv", 64, 256, 8, 3, 1),
                C("gemv", 16, 256, 4, 6, 1), C("gemv", 16, 256, 4, 6, 2), C("gemv", 16, 512, 4, 4, 1),
                C("gemv", 16, 512, 4, 4, 2), C("gemv", 16, 512, 8, 4, 1), C("gemv", 16, 512, 8, 6, 1),
                C("gemv", 16, 1024, 8, 3, 1), C("gemv", 8, 512, 4, 4, 1), C("gemv", 8, 512, 4, 4, 2),
                C("gemv", 8, 1024, 4, 3, 1)]
    pointers = [C("swap", 64, 128, 4, 4, 1), C("swap", 64, 128, 4, 4, 2), C("swap", 128, 128, 4, 3, 2),
                C("swap", 64, 256, 4, 3, 2), C("dot", 32, 128, 4, 4, 2), C("dot", 32, 128, 4, 4, 1)]
    tma = [C("swap", 64, 128, 4, 4, 1), C("swap", 64, 128, 4, 4, 2), C("swap", 64, 256, 4, 3, 1),
           C("swap", 128, 128, 8, 4, 1), C("dot", 32, 128, 4, 4, 1), C("dot", 32, 128, 4, 4, 2),
           C("dot", 64, 128, 4, 4, 1)]
    return pointers + [cfg._replace(tma=True) for cfg in tma]


def _compile_one(job):
    """Run one config once at a small shape with the same specialisation as K2.6's (N, K, strides multiples of
    16, K a multiple of the tile or not as `even`), so Triton's on-disk cache holds its binary for the timed runs."""
    cfg, M, even = job
    K = 4 * cfg.block_k + (0 if even else 16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
    lk.linear_kernel(x, w, cfg)
    torch.cuda.synchronize()


def precompile(ms, ks, workers, defaults):
    """Compile every config the run times at `ms` (the candidates, or with `defaults` the adopted entries) for
    the K values `ks` (whether each is a multiple of the K tile) in `workers` processes; the timed process then
    loads the binaries."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    jobs = {}
    for M in ms:
        if defaults:
            configs = {e.get(lk.bucket_of(M)) for e in lk.ADOPTED["sm_90"].values()} - {None}
        else:
            configs = candidates(M)
        for cfg in configs:
            block_m = lk.plan(cfg, M, 256, 2048, 132).block_m
            for even in {K % cfg.block_k == 0 for K in ks}:
                jobs.setdefault((cfg._replace(waves=2, pdl=False), block_m, even), (cfg, M, even))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_compile_one, jobs.values()))
    return len(jobs)


def label(cfg):
    return (f"{cfg.kind} {cfg.block_n}x{cfg.block_k} w{cfg.warps} s{cfg.stages} x{cfg.waves:g}" + " pdl" * cfg.pdl
            + " tma" * cfg.tma)


def per_call_us(fn, x, copies):
    calls = [lambda w=copies[i % len(copies)]: fn(x, w) for i in range(max(MIN_CALLS, len(copies)))]
    return 1e3 * time_graph(calls)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def weight_copies(N, K, gen):
    """Copies of a random [N, K] bf16 weight, >= 256 MiB together (at least two)."""
    n = max(2, math.ceil(ROTATE_BYTES / (N * K * 2)))
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5 for _ in range(n)]


def measure_point(N, K, M, copies, bw, gen, defaults):
    """cuBLAS and Triton us and %BW at one shape and M, and each Triton output's error against fp32."""
    pct = lambda us: 100 * N * K * 2 / (us * 1e-6) / (bw * 1e9)  # noqa: E731
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x.float(), copies[0].float())
    cublas = per_call_us(F.linear, x, copies)
    row = dict(cublas_us=cublas, cublas_pct=pct(cublas), triton={})
    if defaults:
        cfg = lk.adopted(x.device, M, N, K)
        tried = [cfg] if cfg else []
    else:
        tried = candidates(M)
    for cfg in tried:
        fn = lambda a, w, cfg=cfg: lk.linear_kernel(a, w, cfg)  # noqa: E731
        try:
            err = rel_err(fn(x, copies[0]), ref)
            us = per_call_us(fn, x, copies)
        except Exception as exc:  # a config that fails to compile or launch is recorded, not fatal  # noqa: BLE001
            row["triton"][label(cfg)] = dict(config=list(cfg), error=repr(exc)[:300])
            print(f"N={N} K={K} M={M} {label(cfg)}: {exc!r}"[:400], flush=True)
            continue
        row["triton"][label(cfg)] = dict(config=list(cfg), us=us, pct=pct(us), rel_err=err)
    ok = {k: v for k, v in row["triton"].items() if v.get("rel_err", 1.0) < 1e-2}
    if ok:
        best = min(ok, key=lambda k: ok[k]["us"])
        row.update(best=best, best_us=ok[best]["us"], best_pct=ok[best]["pct"],
                   adopt=ok[best]["us"] <= MARGIN * cublas)
    print(f"N={N} K={K} M={M}: cuBLAS {cublas:.2f} us ({row['cublas_pct']:.0f}%)"
          + (f", Triton {row['best']} {row['best_us']:.2f} us ({row['best_pct']:.0f}%)" if ok else ""), flush=True)
    return row


LAYER = ("q_a+kv_a", "q_b", "o_proj", "shared gate_up", "shared down")  # a MoE layer's projections, in order


def layer_chain(report, copies, ms, gen, table):
    """us per MoE layer of its projections back to back (each reading the next rotating copy of its
    weight): cuBLAS, `ops.linear` on the current ADOPTED['sm_90'] and on `table`: {M: {...}}."""
    by_name = {name: (e, ws) for e, ws in zip(report["shapes"], copies) for name in e["names"]}
    layers = max(len(by_name[name][1]) for name in LAYER)
    xs = {M: {name: torch.randn(M, by_name[name][0]["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
              for name in LAYER} for M in ms}
    saved, out = lk.ADOPTED["sm_90"], {}
    try:
        for M in ms:
            times = {}
            for backend, fn, tbl in (("cublas", F.linear, saved), ("current", lk.linear, saved),
                                     ("adopted", lk.linear, table)):
                lk.ADOPTED["sm_90"] = tbl
                calls = [lambda fn=fn, x=xs[M][name], w=by_name[name][1][i % len(by_name[name][1])]: fn(x, w)
                         for i in range(layers) for name in LAYER]
                times[backend] = 1e3 * time_graph(calls) * len(LAYER)
            out[M] = dict(cublas_us=times["cublas"], current_us=times["current"], adopted_us=times["adopted"],
                          layers=layers)
            print(f"layer chain M={M}: cuBLAS {times['cublas']:.1f} us, current table {times['current']:.1f} us, "
                  f"proposed table {times['adopted']:.1f} us a layer", flush=True)
    finally:
        lk.ADOPTED["sm_90"] = saved
    return out


def step_ab(table, budgets=(0, 32), context=4096, iters=10):
    """The TP8 rank's verify (bench_step's model, drafter and trees, 4k context) as a CUDA-graph replay, captured
    with ADOPTED['sm_90'] = {} (cuBLAS everywhere), with the current table and with `table`: ms per verify per
    budget, and the logits' relative difference and argmax agreement between cuBLAS and `table`."""
    import bench_step as bs
    from spec.graphs import StepGraphs

    target = bs.build_target()
    drafter = bs.build_drafter(target)
    bench = bs.Bench(target, drafter, budgets, context)
    bench.set_context(context)
    inputs = {b: bench.verify_inputs(b) for b in budgets}
    saved, out, logits = lk.ADOPTED["sm_90"], {b: {} for b in budgets}, {b: {} for b in budgets}
    try:
        for name, tbl in (("cublas", {}), ("current", saved), ("adopted", table)):
            lk.ADOPTED["sm_90"] = tbl
            graphs = StepGraphs(target, bench.cache, 1, budgets, drafter.target_layer_ids, log=lambda _: None)
            graphs.capture()
            for b, (tokens, positions, mask) in inputs.items():
                run = lambda: graphs.verify(tokens, positions, mask)  # noqa: E731
                out[b][f"{name}_ms"] = bs.wall_ms(run, iters)
                logits[b][name] = run().logits.float().clone()
            del graphs
    finally:
        lk.ADOPTED["sm_90"] = saved
    for b in budgets:
        a, c = logits[b]["adopted"], logits[b]["cublas"]
        out[b].update(logits_rel_err=rel_err(a, c), argmax_agree=(a.argmax(-1) == c.argmax(-1)).float().mean().item())
        print(f"verify budget {b}: cuBLAS {out[b]['cublas_ms']:.3f} ms, current {out[b]['current_ms']:.3f} ms, "
              f"adopted {out[b]['adopted_ms']:.3f} ms, logits rel diff {out[b]['logits_rel_err']:.2e}, "
              f"argmax agree {out[b]['argmax_agree']:.3f}", flush=True)
    return out


def incumbent(N, K, M, row):
    """(label, us) of the config ADOPTED['sm_90'] now holds for this point, as timed among the candidates (pdl
    aside: every sm_90 launch is on the PDL chain), or None."""
    cfg = lk.ADOPTED["sm_90"].get((N, K), {}).get(lk.bucket_of(M))
    timed = row["triton"].get(label(cfg._replace(pdl=False))) if cfg else None
    return (label(cfg), timed["us"]) if timed and timed.get("rel_err", 1.0) < 1e-2 else None


def proposed(report):
    """The ADOPTED table the measurements give: {(N, K): {bucket: Config}} where Triton beat cuBLAS by MARGIN;
    the current entry stays unless the fastest candidate also beats it by MARGIN, and so do the entries of the
    points not measured."""
    table = {nk: dict(entries) for nk, entries in lk.ADOPTED["sm_90"].items()}
    for entry in report["shapes"]:
        N, K = entry["N"], entry["K"]
        for M, row in entry["rows"].items():
            table.get((N, K), {}).pop(lk.bucket_of(int(M)), None)
            if row.get("adopt"):
                cfg = lk.Config(*row["triton"][row["best"]]["config"])
                now = incumbent(N, K, int(M), row)
                if now and row["best_us"] > MARGIN * now[1]:
                    cfg = lk.ADOPTED["sm_90"][(N, K)][lk.bucket_of(int(M))]
                table.setdefault((N, K), {})[lk.bucket_of(int(M))] = cfg
    return {nk: entries for nk, entries in table.items() if entries}


def markdown(report):
    meta = report["meta"]
    lines = [f"# Dense projections: cuBLAS vs the Triton skinny GEMM ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; read bandwidth {meta['read_gbs']:.0f} GB/s measured "
             f"in this run (sum over 4 GiB). Weights cold in L2 (>= 256 MiB of rotating copies), each point's calls "
             f"in one CUDA graph, us per call; %BW = weight bytes / time / read bandwidth. Mode: {meta['mode']}. "
             "Triton = the fastest candidate (or the adopted config with --defaults).", "",
             "| shape (N x K) | used by | MB | M | cuBLAS us | cuBLAS %BW | Triton us | Triton %BW | Triton config | "
             "x cuBLAS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in report["shapes"]:
        N, K = entry["N"], entry["K"]
        for M in sorted(entry["rows"], key=int):
            row = entry["rows"][M]
            tri = (f"{row['best_us']:.2f} | {row['best_pct']:.0f} | {row['best']} | "
                   f"{row['cublas_us'] / row['best_us']:.2f}") if "best" in row else "- | - | - | -"
            lines.append(f"| {N} x {K} | {', '.join(entry['names'])} | {N * K * 2 / 1e6:.1f} | {M} | "
                         f"{row['cublas_us']:.2f} | {row['cublas_pct']:.0f} | {tri} |")
    for title, pick in (("M = 1", lambda m: m == 1), ("M > 1", lambda m: m > 1)):
        cols = list(dict.fromkeys(k for e in report["shapes"] for m, r in e["rows"].items() if pick(int(m))
                                  for k in r["triton"]))
        if not cols:
            continue
        lines += ["", f"Every candidate, us per call ({title}; 'x' = wrong output or failed):", "",
                  "| N x K | M | cuBLAS | " + " | ".join(cols) + " |", "|---" * (len(cols) + 3) + "|"]
        for e in report["shapes"]:
            for m in sorted((m for m in e["rows"] if pick(int(m))), key=int):
                r = e["rows"][m]
                cells = [f"{r['triton'][c]['us']:.2f}" if r["triton"].get(c, {}).get("rel_err", 1) < 1e-2
                         else ("x" if c in r["triton"] else "") for c in cols]
                lines.append(f"| {e['N']} x {e['K']} | {m} | {r['cublas_us']:.2f} | " + " | ".join(cells) + " |")
    if report.get("layer_chain"):
        lines += ["", "One MoE layer's projections (" + ", ".join(LAYER) + ") back to back in one graph, "
                  "rotating layers' weights, us a layer (x 60 MoE layers is their share of a verify):", "",
                  "| M | cuBLAS | ops.linear, current table | ops.linear, proposed table | x cuBLAS | x current |",
                  "|---|---|---|---|---|---|"]
        for M, c in report["layer_chain"].items():
            current = c.get("current_us", float("nan"))
            lines.append(f"| {M} | {c['cublas_us']:.1f} | {current:.1f} | {c['adopted_us']:.1f} | "
                         f"{c['cublas_us'] / c['adopted_us']:.2f} | {current / c['adopted_us']:.3f} |")
    if report.get("step_ab"):
        lines += ["", "The TP8 rank's verify at 4k context (bench_step's model, CUDA-graph replay, ms), captured with "
                  "cuBLAS for every projection, with ops.linear on the current table and on the proposed one:", "",
                  "| budget | cuBLAS | current table | proposed table | x cuBLAS | logits rel. diff | argmax agree |",
                  "|---|---|---|---|---|---|---|"]
        for b, r in report["step_ab"].items():
            speedup = r["cublas_ms"] / r["adopted_ms"]
            lines.append(f"| {b} | {r['cublas_ms']:.3f} | {r.get('current_ms', 0):.3f} | {r['adopted_ms']:.3f} | "
                         f"{speedup:.3f} | "
                         f"{r['logits_rel_err']:.2e} | {r['argmax_agree']:.3f} |")
    lines += ["", "Fastest candidate against the entry ADOPTED['sm_90'] holds now (timed in this run):", "",
              "| N x K | M | current entry | us | fastest | us | x current |", "|---|---|---|---|---|---|---|"]
    for e in report["shapes"]:
        for m in sorted(e["rows"], key=int):
            r, now = e["rows"][m], incumbent(e["N"], e["K"], int(m), e["rows"][m])
            if now and "best" in r:
                lines.append(f"| {e['N']} x {e['K']} | {m} | {now[0]} | {now[1]:.2f} | {r['best']} | "
                             f"{r['best_us']:.2f} | {now[1] / r['best_us']:.3f} |")
    table = proposed(report)
    lines += ["", f"Triton faster by >= {100 * (1 - MARGIN):.0f}% at {sum(len(v) for v in table.values())} points "
              "(a current entry kept unless the fastest beats it by as much). "
              "Proposed `ADOPTED['sm_90']` (C = Config):", "", "```python", "{"]
    for key, entries in table.items():
        lines.append(f"    {key}: {{{', '.join(f'{b}: C{tuple(cfg)}' for b, cfg in sorted(entries.items()))}}},")
    lines += ["}", "```", ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--budget", type=float, default=600, help="seconds; points past it are skipped")
    parser.add_argument("--defaults", action="store_true", help="time only ops.linear's choice beside cuBLAS")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--compile-workers", type=int, default=8, help="processes that compile the candidates first")
    parser.add_argument("--names", help="only the shapes of these projections (comma-separated, as in shapes())")
    parser.add_argument("--step-ab", action="store_true",
                        help="then the TP8 verify at 4k, cuBLAS vs the table (builds the model)")
    parser.add_argument("--step-budgets", default="0,32", help="tree budgets of the --step-ab verify")
    args = parser.parse_args()
    deadline = time.time() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(m) for m in args.ms.split(",")]
    found = shapes()
    if args.names:
        keep = set(args.names.split(","))
        found = {nk: names for nk, names in found.items() if keep & set(names)}
    if args.compile_workers:
        t0 = time.time()
        try:
            n = precompile(ms, {K for _, K in found}, args.compile_workers, args.defaults)
            print(f"compiled {n} kernels in {time.time() - t0:.1f} s", flush=True)
        except Exception as exc:  # the timed run compiles what is missing  # noqa: BLE001
            print(f"precompile failed after {time.time() - t0:.1f} s: {exc!r}"[:400], flush=True)
    bw = hbm_read_bandwidth()
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), read_gbs=bw,
                mode="defaults" if args.defaults else "candidates", command=" ".join(sys.argv))
    gen = torch.Generator("cuda").manual_seed(0)
    report = dict(meta=meta, shapes=[dict(N=N, K=K, names=names, rows={}) for (N, K), names in found.items()])
    copies = [weight_copies(N, K, gen) for N, K in found]
    for M in ms:  # M outer: a run cut off by --budget still covers every shape at the first Ms
        for entry, ws in zip(report["shapes"], copies):
            if time.time() < deadline:
                entry["rows"][str(M)] = measure_point(entry["N"], entry["K"], M, ws, bw, gen, args.defaults)
        (args.out / "linear.json").write_text(json.dumps(report, indent=1))
    table = lk.ADOPTED["sm_90"] if args.defaults else proposed(report)
    measured = {name for e in report["shapes"] for name in e["names"]}
    chain_ms = [m for m in (1, 9, 33) if str(m) in report["shapes"][0]["rows"]] if set(LAYER) <= measured else []
    if chain_ms and time.time() < deadline + 20:
        report["layer_chain"] = layer_chain(report, copies, chain_ms, gen, table)
        (args.out / "linear.json").write_text(json.dumps(report, indent=1))
    if args.step_ab:
        del copies
        torch.cuda.empty_cache()
        try:
            report["step_ab"] = step_ab(table, tuple(int(b) for b in args.step_budgets.split(",")))
        except Exception as exc:  # the sweep's results still get their table  # noqa: BLE001
            report["step_ab_error"] = repr(exc)[:500]
            print(f"step A/B failed: {exc!r}"[:600], flush=True)
        (args.out / "linear.json").write_text(json.dumps(report, indent=1))
    (args.out / "linear.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
