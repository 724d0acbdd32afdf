"""The skinny GEMM at verify sizes (M 17-65): where a call's time goes, per config.

For each (shape of the verify step, M, config of CONFIGS): the call's time (cold L2, CUDA graph, as bench_linear
times it) beside cuBLAS, then one call of a stamped copy of linear.py (%globaltimer at a program's entry, after
its K loop, after its partial's store and arrival, after the last program's sum) for per-phase times.

Usage (device): python bench/probe_linear.py --out DIR [--ms 33,65,17]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_linear as bl  # noqa: E402
from bench_moe import hbm_read_bandwidth  # noqa: E402
from probe_attention_timeline import STAMP, _insert, load_source  # noqa: E402
from triton_kernels import linear as lk  # noqa: E402

C = lk.Config
STEP_SHAPES = {(2112, 7168): "q_a+kv_a", (1536, 1536): "q_b", (7168, 1024): "o_proj",
               (512, 7168): "shared gate_up", (7168, 256): "shared down"}
CONFIGS = [C("swap", 64, 128, 4, 4, 1), C("dot", 32, 128, 4, 4, 1)] + [
    C(*cfg, tma=True) for cfg in [("swap", 64, 128, 4, 4, 1), ("swap", 64, 128, 4, 4, 2), ("swap", 128, 128, 8, 4, 1),
                                  ("swap", 128, 64, 8, 6, 1), ("swap", 256, 64, 8, 4, 1), ("swap", 64, 256, 4, 3, 1),
                                  ("dot", 32, 128, 4, 4, 1), ("dot", 64, 128, 4, 4, 1)]]
PHASES = ("entry", "looped", "arrived", "summed")


def _replace(src, old, new):
    """src with its one `old` replaced by `new` (an anchor that no longer matches the kernel is an error)."""
    if src.count(old) != 1:
        raise ValueError(f"probe_linear: anchor {old[:60]!r} found {src.count(old)} times in linear.py")
    return src.replace(old, new)


def stamped_module():
    """A copy of triton_kernels/linear.py whose _dot_kernel stamps its phases to the module global TIMES."""
    src = Path(lk.__file__).read_text()
    src = _replace(src, "import triton.language as tl\n", "import triton.language as tl\n" + STAMP + "\nTIMES = None\n")
    src = _replace(src, "split, splits, REDUCE_LOADS: tl.constexpr,\n            RAW: tl.constexpr):",
                   "split, splits, REDUCE_LOADS: tl.constexpr,\n            RAW: tl.constexpr, times_ptr):")
    src = _insert(src, r"arrived = tl\.atomic_add", "_stamp(times_ptr, 2, arrived)")
    src = _insert(src, r"tl\.atomic_xchg\(count_ptr", "_stamp(times_ptr, 3, arrived)")
    src = _replace(src, "                REDUCE_LOADS: tl.constexpr = 4, RAW: tl.constexpr = False):\n    \"\"\"y [M, N]",
                   "                REDUCE_LOADS: tl.constexpr = 4, RAW: tl.constexpr = False, times_ptr=None):\n"
                   "    \"\"\"y [M, N]")
    src = _replace(src, "tl.program_id(1)\n    offs_m = tl.arange(0, BLOCK_M)",
                   "tl.program_id(1)\n    _stamp(times_ptr, 0, pid_n)\n    offs_m = tl.arange(0, BLOCK_M)")
    src = _replace(src, "    _finish(acc, m, n, M, N, y_ptr, part_ptr, count_ptr, pid_n, split, splits, REDUCE_LOADS, RAW)",
                   "    _stamp(times_ptr, 1, tl.sum(tl.sum(acc, 1), 0))\n    _finish(acc, m, n, M, N, y_ptr, part_ptr, "
                   "count_ptr, pid_n, split, splits, REDUCE_LOADS, RAW, times_ptr)")
    src = _replace(src, "num_stages=p.stages,", "num_stages=p.stages, times_ptr=TIMES,")
    return load_source("linear_stamped", src)


def phases(module, x, w, cfg):
    """Per-phase (median, max) us over the programs of one call, the last programs' sum, and the call's span."""
    p = lk.plan(cfg, x.shape[0], w.shape[0], w.shape[1], torch.cuda.get_device_properties(0).multi_processor_count)
    module.TIMES = torch.zeros(p.tiles * p.splits, 32, dtype=torch.int64, device="cuda")
    module.linear_kernel(x, w, cfg)
    torch.cuda.synchronize()
    t = module.TIMES[:, :4].double().cpu()
    stat = lambda v: (round(v.median().item() / 1e3, 2), round(v.max().item() / 1e3, 2))  # noqa: E731
    out = dict(tiles=p.tiles, splits=p.splits, k_per_split=p.k_per_split, stages=p.stages,
               loop=stat(t[:, 1] - t[:, 0]))
    if p.splits > 1:
        last = t[:, 3] > 0
        out.update(arrive=stat(t[:, 2] - t[:, 1]), reduce=stat(t[last, 3] - t[last, 2]),
                   span=round((t[:, 3].max() - t[:, 0].min()).item() / 1e3, 2))
    else:
        out["span"] = round((t[:, 1].max() - t[:, 0].min()).item() / 1e3, 2)
    out["entry_spread"] = round((t[:, 0].max() - t[:, 0].min()).item() / 1e3, 2)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ms", default="33,65,17")
    parser.add_argument("--budget", type=float, default=200)
    args = parser.parse_args()
    deadline = time.time() + args.budget
    stamped = stamped_module()
    bw = hbm_read_bandwidth()
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for (N, K), name in STEP_SHAPES.items():
        copies = bl.weight_copies(N, K, gen)
        for M in (int(m) for m in args.ms.split(",")):
            if time.time() > deadline:
                break
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), copies[0].float())
            row = dict(N=N, K=K, name=name, M=M, cublas_us=round(bl.per_call_us(F.linear, x, copies), 2), configs={})
            for cfg in CONFIGS:
                fn = lambda a, w, cfg=cfg: lk.linear_kernel(a, w, cfg)  # noqa: E731
                try:
                    err = bl.rel_err(fn(x, copies[0]), ref)
                    entry = dict(us=round(bl.per_call_us(fn, x, copies), 2) if err < 1e-2 else f"err {err}")
                    entry["phases"] = phases(stamped, x, copies[1], cfg)
                except Exception as exc:  # noqa: BLE001
                    entry = dict(us=repr(exc)[:200])
                row["configs"][bl.label(cfg)] = entry
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), read_gbs=bw, command=" ".join(sys.argv))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_probe.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
