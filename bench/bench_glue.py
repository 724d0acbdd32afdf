"""Launch options of small verify-step kernels on the GPU: the absorbed query (`absorb_query`, tokens per
program), the absorbed output (`absorb_output`, its tile `absorb.OUTPUT_TILE`) and the router (its default launches, the logits kernel alone, whose difference to the default is the
select's share, and the logits kernel's token block and D tile, `router.LOGITS_TILES`), at one TP8 rank's shapes
(8 heads, E = 384, D = 7168) for 1-129 tree nodes.

`python bench/bench_glue.py --out DIR [--ops router] [--tiles 16x256,...]`: each op is captured 20 times back to
back in one CUDA graph and timed as a replay (median, CUDA events), so the figure is its in-step cost (kernel
plus launch gap) per call; outputs are checked against the default launch. Writes glue.json and glue.md.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from bench_tree import graph_of  # bench/ is on sys.path when this file runs as a script
from triton_kernels import absorb, router
from triton_kernels import linear as lk

ROWS = (1, 9, 33, 65, 129)
REPEAT = 20


def per_call_us(fn):
    graph = graph_of(lambda: [fn() for _ in range(REPEAT)])
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / REPEAT


def absorb_rows(n, block_ns):
    dev = "cuda"
    q = torch.randn(n, 8, 192, device=dev, dtype=torch.bfloat16)
    w = torch.randn(8, 128, 512, device=dev, dtype=torch.bfloat16) / 12
    pos = torch.arange(n, device=dev) + 4000
    freq = 1.0 / (10000 ** (torch.arange(32, device=dev).float() / 32))
    call = lambda: absorb.absorb_query(q[:, :, :128], q[:, :, 128:], w, pos, freq, 1.0)  # noqa: E731
    base, row = call(), {}
    default = absorb.QUERY_BLOCK_N
    try:
        for bn in block_ns:
            absorb.QUERY_BLOCK_N = bn
            row[f"block_n {bn}"] = dict(us=per_call_us(call), equal=bool(torch.equal(call(), base)))
    finally:
        absorb.QUERY_BLOCK_N = default
    return row


def absorb_output_rows(n, tiles):
    """absorb_output at each (BLOCK_D, BLOCK_K, stages) of `tiles` ('default': absorb.OUTPUT_TILES)."""
    dev = "cuda"
    o = torch.randn(n, 8, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(8, 128, 512, device=dev, dtype=torch.bfloat16) / 22
    call = lambda: absorb.absorb_output(o, w)  # noqa: E731
    base, row = call(), {}
    default = absorb.OUTPUT_TILES
    row["default"] = dict(us=per_call_us(call), equal=True)
    try:
        for tile in tiles:
            absorb.OUTPUT_TILES = ((None, *tile),)
            got = call()
            row["x".join(map(str, tile))] = dict(us=per_call_us(call), equal=bool((got - base).abs().max() < 1e-2))
    finally:
        absorb.OUTPUT_TILES = default
    return row


def timed_route(call, base):
    """call's time and whether its (weights, ids) match base's: ids exactly, weights to 1e-5 (their logits are
    summed in another order)."""
    got_w, got_ids = call()
    ok = torch.equal(got_ids, base[1]) and (got_w - base[0]).abs().max().item() < 1e-5
    return dict(us=per_call_us(call), equal=bool(ok))


def router_rows(m, tiles, gemvs=(), many=()):
    dev = "cuda"
    x = torch.randn(m, 7168, device=dev, dtype=torch.bfloat16)
    w = torch.randn(384, 7168, device=dev, dtype=torch.bfloat16) / 85
    bias = 0.01 * torch.randn(384, device=dev)
    call = lambda: router.route(x, w, bias, 8, 1, 1, 2.827)  # noqa: E731
    base = call()
    logits = lambda: router.logits(x, w)  # noqa: E731
    row = {"default": dict(us=per_call_us(call), equal=True), "logits alone": dict(us=per_call_us(logits), equal=True)}
    default, many_default = router.LOGITS_TILES, router.MANY_ROWS
    try:
        router.MANY_ROWS = None  # the logits kernel at every token count
        for block_m, block_d in tiles:
            router.LOGITS_TILES = ((None, block_m, block_d),)
            row[f"logits {block_m}x{block_d}"] = timed_route(call, base)
    finally:
        router.LOGITS_TILES, router.MANY_ROWS = default, many_default
    if m == 1:  # one token: the gemv's unsummed K-split partials instead of the dot kernel (router.ONE_ROW_GEMV)
        default = router.ONE_ROW_GEMV
        try:
            for cfg in gemvs:
                router.ONE_ROW_GEMV = cfg
                name = f"gemv {cfg.block_n}x{cfg.block_k} s{cfg.stages} x{cfg.waves:g}"
                row[name] = timed_route(call, base)
                row[f"{name}, logits alone"] = dict(us=per_call_us(logits), equal=True)
        finally:
            router.ONE_ROW_GEMV = default
    if 1 < m <= lk.MAX_ROWS:  # the skinny GEMM's dot tiles, partials unsummed (router.MANY_ROWS)
        default = router.MANY_ROWS
        try:
            for cfg in many:
                router.MANY_ROWS = cfg
                name = f"{cfg.kind} {cfg.block_n}x{cfg.block_k} s{cfg.stages} x{cfg.waves:g}" + " tma" * cfg.tma
                row[name] = timed_route(call, base)
                row[f"{name}, logits alone"] = dict(us=per_call_us(logits), equal=True)
        finally:
            router.MANY_ROWS = default
    return row


GEMVS = [lk.Config("gemv", 8, 512, 4, 4, 1), lk.Config("gemv", 8, 512, 4, 4, 2), lk.Config("gemv", 16, 256, 4, 6, 1),
         lk.Config("gemv", 16, 512, 4, 4, 1), lk.Config("gemv", 16, 256, 4, 6, 2), lk.Config("gemv", 32, 256, 4, 3, 2)]


MANY = [lk.Config("dot", 32, 128, 4, 4, 1, tma=True), lk.Config("swap", 64, 128, 4, 4, 1, tma=True),
        lk.Config("swap", 64, 128, 4, 4, 0.5, tma=True), lk.Config("dot", 64, 128, 4, 4, 1, tma=True)]


def _tiles(text):
    return [tuple(int(v) for v in tile.split("x")) for tile in text.split(",") if tile]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ops", default="absorb_query,router",
                        help="comma-separated: absorb_query, absorb_output, router")
    parser.add_argument("--output-tiles", default="32x128x2,32x256x2,32x512x1,16x512x1,16x256x2,64x128x2",
                        type=_tiles, help="absorb_output's BLOCK_D x BLOCK_K x stages to time")
    parser.add_argument("--tiles", default="16x256,32x256,64x128,64x256", type=_tiles,
                        help="the router's logits tiles BLOCK_M x BLOCK_D to time at every row count ('' for none)")
    parser.add_argument("--gemvs", action="store_true", help="the router's one-token gemv candidates (GEMVS)")
    parser.add_argument("--many", action="store_true", help="the router's 2-128 token skinny-GEMM candidates (MANY)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ops = args.ops.split(",")
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), repeat=REPEAT)
    report = dict(meta=meta, **{op: {} for op in ops})
    gemvs = GEMVS if args.gemvs else ()
    many = MANY if args.many else ()
    rows_of = dict(absorb_query=lambda n: absorb_rows(n, (16, 32, 64)),
                   absorb_output=lambda n: absorb_output_rows(n, args.output_tiles),
                   router=lambda n: router_rows(n, args.tiles, gemvs, many))
    for n in ROWS:
        for op in ops:
            report[op][n] = rows_of[op](n)
            print(n, op, json.dumps(report[op][n]), flush=True)
        (args.out / "glue.json").write_text(json.dumps(report, indent=1))
    lines = [f"# {' and '.join(ops)} launch options ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; us per call, {REPEAT} calls in one CUDA graph; "
             "'!' marks an output different from the default launch's.", ""]
    for op in ops:
        labels = list(dict.fromkeys(k for row in report[op].values() for k in row))
        lines += [f"## {op}", "", "| rows | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for n, row in report[op].items():
            cells = (f"{row[k]['us']:.2f}{'' if row[k]['equal'] else ' !'}" if k in row else "-" for k in labels)
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    (args.out / "glue.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
