"""Old benchmarks against the new sweeps, case by case: the new time over the old one (same GPU, same call).

    python -m bench.compare OLD_DIR NEW_DIR [--all]

OLD_DIR holds what the old scripts (bench_moe.py --variants, bench_attention.py, bench_tree.py, bench_linear.py
--defaults, bench_glue.py, bench_step.py of commit aa1fe5d) wrote; NEW_DIR the `pytest bench --benchmark-json` files
and bench_step.py's step.json. Every JSON file under each folder is read; cases match by key (the new sweeps' `key`
field, built from the old files' fields). Prints each op's median, lowest and highest ratio, the cases off by more
than 10% (with --all: every case), and how many cases matched.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

TREE_FIELDS = dict(topk="topk_graph_us", build="build_graph_us", accept_greedy="accept_greedy_graph_us",
                   accept_T1="accept_T1_graph_us", compact="compact_graph_us", step_eager="step_eager_us",
                   step_greedy="step_graph_greedy_us", step_T1="step_graph_T1_us")
OLD_GLUE_DEFAULT = {"absorb_query": "block_n 16", "absorb_output": "default", "router": "default"}  # at aa1fe5d


def attention_key(c):
    return (f"attention L{c['L']}-H{c['H']}-T{c['T']}" + ("-causal" if c.get("causal") else "")
            + (f"-pad{c['pad']}" if c.get("pad") else ""))


def step_times(report):
    for r in report["rows"]:
        name = f"step ctx={r['context']} budget={r['budget']}"
        yield f"{name} verify_graph", 1e3 * r["verify_graph_ms"]
        for field in ("step_ms", "ar_step_ms"):
            if r.get(field):
                yield f"{name} {field[:-3]}", 1e3 * r[field]


def times(report):
    """(key, us) of every case a benchmark's JSON holds, old or new."""
    if "benchmarks" in report:  # pytest-benchmark
        yield from ((b["extra_info"]["key"], b["extra_info"]["us"]) for b in report["benchmarks"]
                    if b.get("extra_info", {}).get("us") is not None)
    elif "cases" in report:  # bench_attention.py
        yield from ((attention_key(c), c["us"]) for c in report["cases"] if "us" in c)
    elif "results" in report:  # bench_tree.py
        for r in report["results"]:
            yield from ((f"tree budget={r['budget']} block={r['block']} {piece}", r[field])
                        for piece, field in TREE_FIELDS.items() if field in r)
    elif "shapes" in report:  # bench_linear.py --defaults: the adopted Triton config where there is one
        for s in report["shapes"]:
            for m, r in s["rows"].items():
                key = f"linear {s['N']}x{s['K']} M={m}"
                yield f"{key} cublas", r["cublas_us"]
                adopted = [t["us"] for t in r["triton"].values() if "us" in t]
                yield f"{key} ops", adopted[0] if adopted else r["cublas_us"]
    elif "rows" in report and report["rows"] and "verify_graph_ms" in report["rows"][0]:  # bench_step.py
        yield from step_times(report)
    elif "rows" in report:  # bench_moe.py --variants
        for r in report["rows"]:
            if "us" in r.get("variants", {}).get("default", {}):
                yield (f"moe {r['shape']} M={r['M']} {r['routing']}" + ("" if r.get("gap") else " nogap"),
                       r["variants"]["default"]["us"])
    else:  # bench_glue.py
        for op, label in OLD_GLUE_DEFAULT.items():
            for n, row in report.get(op, {}).items():
                if "us" in row.get(label, {}):
                    yield f"glue {op} n={n}", row[label]["us"]


def collect(folder):
    found = {}
    for path in sorted(Path(folder).rglob("*.json")):
        try:
            found.update(times(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"skipped {path}: {exc!r}", file=sys.stderr)
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--all", action="store_true", help="print every matched case")
    args = parser.parse_args(argv)
    old, new = collect(args.old), collect(args.new)
    matched = sorted(set(old) & set(new))
    if not matched:
        print(f"error: no case of {args.old} matches one of {args.new} ({len(old)} old, {len(new)} new cases)",
              file=sys.stderr)
        return 2
    print("| op | cases | median new/old | lowest | highest | off by > 10% |\n|---|---|---|---|---|---|")
    for op in dict.fromkeys(k.split()[0] for k in matched):
        ratios = {k: new[k] / old[k] for k in matched if k.split()[0] == op}
        off = sum(abs(r - 1) > 0.1 for r in ratios.values())
        print(f"| {op} | {len(ratios)} | {statistics.median(ratios.values()):.3f} | {min(ratios.values()):.3f} | "
              f"{max(ratios.values()):.3f} | {off} |")
    print("\n| case | old us | new us | new/old |\n|---|---|---|---|")
    for k in matched:
        if args.all or abs(new[k] / old[k] - 1) > 0.1:
            print(f"| {k} | {old[k]:.2f} | {new[k]:.2f} | {new[k] / old[k]:.3f} |")
    print(f"\n{len(matched)} cases matched; {len(set(old) - set(new))} old and {len(set(new) - set(old))} new "
          "unmatched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
