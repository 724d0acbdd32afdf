"""Markdown tables from a `pytest bench --benchmark-json F` file: one file per sweep and GPU, a table per test.

    python -m bench.render F.json                   # print every sweep's tables
    python -m bench.render F.json --out bench/results   # write <sweep>_<gpu>.md and .json (without raw rounds)

Each table: a case's parameters, the fields it recorded, the GPU time per call, bytes, achieved GB/s and TFLOP/s,
the roofline time and the fraction of it reached; the header names the GPU, versions, date and the ceilings
measured in that run; the method is the sweep's own docstring.
"""

import argparse
import ast
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
METRICS = ("us", "bytes", "gbs", "tflops", "roofline_us", "roofline_frac")
HIDDEN = {"key", "flops", "read_gbs", "matmul_tflops"} | set(METRICS)
PIVOT = {"linear": "impl", "tree": "piece"}  # tables whose cases differ in one parameter: its values as columns
HEADINGS = {"us": "us", "bytes": "MB", "gbs": "GB/s", "tflops": "TFLOP/s", "roofline_us": "roofline us",
            "roofline_frac": "of roofline"}


def fmt(value, name=""):
    if value is None:
        return "-"
    if name == "bytes":
        return f"{value / 1e6:.1f}"
    if name == "roofline_frac":
        return f"{value:.0%}"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if name == "rel_err":
        return f"{value:.1e}"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def gpu_slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'h100'; a name without a model number -> its words joined by '_'."""
    model = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name)
    return (model.group(1) if model else "_".join(name.split())).lower()


def sweep_of(bench):
    """The sweep a benchmark belongs to: its file's stem without 'test_' ('moe', 'attention', ...)."""
    return Path(bench["fullname"].split("::")[0]).stem.removeprefix("test_")


def method(sweep):
    """The sweep's docstring (bench/test_<sweep>.py), a line a paragraph."""
    path = BENCH / f"test_{sweep}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) if path.exists() else ""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in (doc or "").split("\n\n"))


def table(benches, pivot=None):
    """Markdown lines of one test's cases: a row each, or with `pivot` a row per value of the other parameters and
    the pivot parameter's values as columns (its time and, where recorded, its fraction of the roofline)."""
    params = [p for p in benches[0]["params"] if p != pivot]
    fields = [k for k in benches[0]["extra_info"] if k not in HIDDEN and not (pivot and k in ("rel_err", "exact"))]
    if not pivot:
        head = params + fields + [HEADINGS[m] for m in METRICS]
        rows = [[fmt(b["params"][p]) for p in params] + [fmt(b["extra_info"].get(f), f) for f in fields]
                + [fmt(b["extra_info"].get(m), m) for m in METRICS] for b in benches]
    else:
        values = list(dict.fromkeys(b["params"][pivot] for b in benches))
        framed = {v for v in values if any(b["extra_info"].get("roofline_frac") for b in benches
                                           if b["params"][pivot] == v)}
        cells, grouped = [(v, "us") for v in values] + [(v, "roofline_frac") for v in values if v in framed], {}
        head = params + fields + [f"{v} {HEADINGS[m]}" for v, m in cells]
        for b in benches:
            grouped.setdefault(tuple(fmt(b["params"][p]) for p in params), {})[b["params"][pivot]] = b["extra_info"]
        rows = [list(k) + [fmt(next(iter(by.values())).get(f), f) for f in fields]
                + [fmt(by.get(v, {}).get(m), m) for v, m in cells] for k, by in grouped.items()]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(sweep, benches, machine):
    """One sweep's results file: header (GPU, versions, date, ceilings), method, a table per test."""
    info = machine.get("bench", {})
    first = benches[0]["extra_info"]
    lines = [f"# {sweep} sweep ({info.get('gpu', '?')}, {info.get('date', '?')})", "",
             f"torch {info.get('torch')}, triton {info.get('triton')}, CUDA {info.get('cuda')}, {info.get('arch')} "
             f"({info.get('sms')} SMs). Ceilings measured in this run: read {fmt(first.get('read_gbs'))} GB/s, bf16 "
             f"matmul {fmt(first.get('matmul_tflops'))} TFLOP/s. Times: GPU median per call.", "", method(sweep)]
    for group in dict.fromkeys(b["group"] for b in benches):
        members = [b for b in benches if b["group"] == group]
        lines += ["", f"## {group}", ""] + table(members, PIVOT.get(group))
    return "\n".join(lines) + "\n"


def render(report, out=None):
    """{sweep: markdown} of a pytest-benchmark report; with `out`, written there with each sweep's JSON slice."""
    by_sweep = {}
    for bench in report["benchmarks"]:
        if bench.get("extra_info", {}).get("us") is not None:
            group = bench.get("group") or bench["name"].split("[")[0].removeprefix("test_")
            by_sweep.setdefault(sweep_of(bench), []).append(dict(bench, params=bench.get("params") or {}, group=group))
    pages = {sweep: markdown(sweep, benches, report["machine_info"]) for sweep, benches in by_sweep.items()}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        gpu = gpu_slug(report["machine_info"].get("bench", {}).get("gpu", "unknown"))
        for sweep, page in pages.items():
            (out / f"{sweep}_{gpu}.md").write_text(page)
            slim = [dict(b, stats={k: v for k, v in b["stats"].items() if k != "data"}) for b in by_sweep[sweep]]
            (out / f"{sweep}_{gpu}.json").write_text(json.dumps(dict(report, benchmarks=slim), indent=1))
    return pages


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="the file `pytest bench --benchmark-json` wrote")
    parser.add_argument("--out", type=Path, help="folder for <sweep>_<gpu>.md and .json (default: print)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.json.read_text())
        pages = render(report, args.out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {args.json}: not a pytest-benchmark report ({exc})", file=sys.stderr)
        return 2
    if not pages:
        print(f"error: {args.json}: no timed benchmark in it", file=sys.stderr)
        return 2
    if not args.out:
        print("\n".join(pages.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
