"""One line per row of a bench_step.py json: the budget, the verify graph ms, verify / floor, and kernels of its eager
profile (us summed over the 61 layers): the six largest, or with --match those whose names hold one of the words.

    python bench/step_summary.py step.json [--match gemv,norm] [--tag TEXT]
"""

import argparse
import json
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json")
    parser.add_argument("--match", default="", help="comma-separated words: kernels whose names hold one")
    parser.add_argument("--tag", default="", help="printed after the file name (e.g. the seconds elapsed)")
    args = parser.parse_args()
    words = [w for w in args.match.split(",") if w]
    for r in json.loads(Path(args.json).read_text())["rows"]:
        kernels = ([k for k in r["top_kernels"] if any(w in k[0] for w in words)] if words else r["top_kernels"][:6])
        print(Path(args.json).name, args.tag, r["budget"], round(r["verify_graph_ms"], 3),
              round(r["verify_graph_over_floor"], 2), [(k[0][:24], k[1], round(k[2])) for k in kernels])


if __name__ == "__main__":
    main()
