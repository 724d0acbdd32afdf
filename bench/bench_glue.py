"""Launch options of two small verify-step kernels on the GPU: the absorbed query (`absorb_query`, tokens per
program) and the router (one launch against two, `router.FUSED_MAX_ROWS`), at one TP8 rank's shapes (8 heads,
E = 384, D = 7168) for 1-129 tree nodes.

`python bench/bench_glue.py --out DIR [--ops router]`: each op is captured 20 times back to back in one CUDA
graph and timed as a replay (median, CUDA events), so the figure is its in-step cost (kernel plus launch gap) per
call; outputs are checked against the two-launch path (router) or the default launch (absorb_query). Router
columns: both launches, the logits kernel alone (the select's share is the difference), and the one launch
(at FUSED_ROWS only). Writes glue.json and glue.md.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from bench_tree import graph_of  # bench/ is on sys.path when this file runs as a script
from triton_kernels import absorb, router

ROWS = (1, 9, 33, 65, 129)
FUSED_ROWS = (1, 9)  # rows at which the router's one launch is timed
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


def router_rows(m):
    dev = "cuda"
    x = torch.randn(m, 7168, device=dev, dtype=torch.bfloat16)
    w = torch.randn(384, 7168, device=dev, dtype=torch.bfloat16) / 85
    bias = 0.01 * torch.randn(384, device=dev)
    call = lambda: router.route(x, w, bias, 8, 1, 1, 2.827)  # noqa: E731
    default = router.FUSED_MAX_ROWS
    try:
        router.FUSED_MAX_ROWS = 0
        base_w, base_ids = call()
        row = {"two launches": dict(us=per_call_us(call), equal=True)}
        block_m, block_d, splits, d_per_split = router.logits_plan(m, 384, 7168, x.device)
        grid = (384 // router.BLOCK_E, triton.cdiv(m, block_m), splits)
        part = torch.empty(splits, m, 384, device=dev)
        logits = lambda: router._logits_kernel[grid](  # noqa: E731
            x, w, part, m, 384, 7168, d_per_split, BLOCK_M=block_m, BLOCK_E=router.BLOCK_E, BLOCK_D=block_d,
            EVEN_D=True, num_stages=3, **router.pdl.options(x))
        row["logits alone"] = dict(us=per_call_us(logits), equal=True)
        if m in FUSED_ROWS:
            router.FUSED_MAX_ROWS = m
            got_w, got_ids = call()
            ok = torch.equal(got_ids, base_ids) and torch.equal(got_w, base_w)
            row["one launch"] = dict(us=per_call_us(call), equal=bool(ok))
    finally:
        router.FUSED_MAX_ROWS = default
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ops", default="absorb_query,router", help="comma-separated: absorb_query, router")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ops = args.ops.split(",")
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), repeat=REPEAT)
    report = dict(meta=meta, **{op: {} for op in ops})
    rows_of = dict(absorb_query=lambda n: absorb_rows(n, (16, 32, 64)), router=router_rows)
    for n in ROWS:
        for op in ops:
            report[op][n] = rows_of[op](n)
            print(n, op, json.dumps(report[op][n]), flush=True)
        (args.out / "glue.json").write_text(json.dumps(report, indent=1))
    lines = [f"# {' and '.join(ops)} launch options ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; us per call, {REPEAT} calls in one CUDA graph; "
             "'!' marks an output different from the reference launch's.", ""]
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
