"""Where an attention call's time goes: the split and merge kernels with %globaltimer / %clock64 stamps.

The committed kernels' source is copied with stamps inserted at a few points (a program's entry, after its PDL
wait and the length, after its query, after the unmasked and the masked loops, at its end; the merge's entry,
after its wait, after its lse and its o loads, its end), each stamp made to depend on the value computed before it
so that it is not issued early. The stamped call runs as the last of a CUDA graph over rotated caches (cache
cold in L2, as bench_attention times it); its stamps give per-phase times (median and max over programs) and the
span from the split kernel's first program to the merge's last.

--gluon stamps the Gluon split kernel (`mla_gluon`, sm_90) instead: entry, after the length, then in its first
warpgroup: after the query's TMA, after the first tile's scores, after the loop, after both warpgroups' final
arrival (fin), at its end (its partials' stores issued).

Usage (device): python bench/probe_attention_timeline.py --out DIR [--gluon] L,H,T[,pad] ...
"""

import argparse
import inspect
import json
import re
import tempfile
from pathlib import Path

import torch

import bench_attention as ba
from triton_kernels import mla_attention as mk
from triton_kernels import mla_gluon

STAMP = '''
@triton.jit
def _stamp(times_ptr, slot: tl.constexpr, dep):
    """Write %globaltimer (ns) and %clock64 of this program to times_ptr[prog * 32 + slot (+ 16)]."""
    prog = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    dep = dep.to(tl.int32, bitcast=True) if dep.dtype == tl.float32 else dep.to(tl.int32)
    ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(times_ptr + prog * 32 + slot, ns)
    tl.store(times_ptr + prog * 32 + 16 + slot, clk)
    if slot == 0:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(times_ptr + prog * 32 + 15, sm.to(tl.int64))
'''

GLUON_STAMP = '''
@gluon.jit
def _stamp(times_ptr, slot: gl.constexpr, dep):
    """_stamp of the Triton kernels for a Gluon kernel (dep a scalar): one lane's stamps."""
    prog = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    dep = dep.to(gl.int32, bitcast=True) if dep.dtype == gl.float32 else dep.to(gl.int32)
    x = gl.full([1], 0, gl.int32, lane) + dep
    ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1)
    clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(times_ptr + prog * 32 + slot + x * 0, ns)
    gl.store(times_ptr + prog * 32 + 16 + slot + x * 0, clk)
    if slot == 0:
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(times_ptr + prog * 32 + 15 + x * 0, sm.to(gl.int64))
'''

SPLIT_PHASES = ("entry", "waited", "query", "unmasked", "masked", "end")
GLUON_PHASES = ("entry", "length", "query", "first_tile", "loop", "fin", "end")
MERGE_PHASES = ("entry", "waited", "lse", "o", "end")


def _insert(src, anchor, line, after=True):
    """src with `line` (indented as the anchor's line) inserted after (or before) the first line matching anchor."""
    lines = src.split("\n")
    i = next(i for i, text in enumerate(lines) if re.search(anchor, text))
    indent = re.match(r"\s*", lines[i]).group(0)
    lines.insert(i + 1 if after else i, indent + line)
    return "\n".join(lines)


def stamped_module():
    """A module with stamped copies of _mla_split_kernel and _merge_kernel (each takes times_ptr last)."""
    split = inspect.getsource(mk._mla_split_kernel.fn)
    split = split.replace("PDL: tl.constexpr = False,\n):", "PDL: tl.constexpr = False, times_ptr=None,\n):")
    split = _insert(split, r"pdl\.wait\(PDL\)", "_stamp(times_ptr, 0, pid_s)", after=False)
    split = _insert(split, r"length = tl\.load", "_stamp(times_ptr, 1, length)")
    split = _insert(split, r"q_pe = tl\.load", "_stamp(times_ptr, 2, tl.sum(tl.sum(q_pe.to(tl.float32), 1), 0))")
    split = _insert(split, r"for j0 in tl\.range", "_stamp(times_ptr, 3, tl.sum(l_i, 0))", after=False)
    split = _insert(split, r"o = acc / tl\.where", "_stamp(times_ptr, 4, tl.sum(l_i, 0))", after=False)
    split = _insert(split, r"^    pdl\.release\(PDL\)", "_stamp(times_ptr, 5, tl.sum(l_i, 0))", after=False)
    merge = inspect.getsource(mk._merge_kernel.fn)
    merge = merge.replace("PDL: tl.constexpr = False):", "PDL: tl.constexpr = False, times_ptr=None):")
    merge = _insert(merge, r"pdl\.enter\(PDL\)", "_stamp(times_ptr, 0, tl.program_id(0))", after=False)
    merge = _insert(merge, r"pdl\.enter\(PDL\)", "_stamp(times_ptr, 1, tl.program_id(0))")
    merge = _insert(merge, r"lse = tl\.load", "_stamp(times_ptr, 2, tl.sum(lse, 0))")
    merge = _insert(merge, r"o = o\.to\(tl\.float32\)", "_stamp(times_ptr, 3, tl.sum(tl.sum(o, 1), 0))")
    merge = _insert(merge, r"out = acc / w_sum", "_stamp(times_ptr, 4, tl.sum(acc, 0))")
    header = ("import triton\nimport triton.language as tl\nfrom triton_kernels import pdl\n"
              "from triton_kernels.mla_attention import _scores, _tma_scores, _sum_scores, _probs, _softmax_step, "
              "program_range\n")
    return load_source("stamped_attention", header + STAMP + "\n\n" + split + "\n\n" + merge)


RELEASE = '''
@gluon.jit
def _launch_dependents(dep):
    """griddepcontrol.launch_dependents: the next kernel (PDL) may launch once every program has executed this."""
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    x = gl.full([1], 0, gl.int32, lane) + dep
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                              is_pure=False, pack=1)
'''


def stamped_gluon_module(release_early=False):
    """A copy of mla_gluon whose _split_kernel takes times_ptr last (passed to the partitions in `work`) and stamps
    GLUON_PHASES, those in the partitions from warpgroup 0's. release_early: its loader lets the merge (launched
    with PDL) launch at once, so the merge's programs wait beside the split kernel's instead of launching after it."""
    src = inspect.getsource(mla_gluon)
    if release_early:
        src = _insert(src, r"mbarrier\.expect\(q_bar", "_launch_dependents(n_tiles)", after=False)
    signature_end = "PDL: gl.constexpr = False):\n"  # the split kernel's last parameter
    assert src.count(signature_end) == 1, "mla_gluon._split_kernel's signature changed: update the probe"
    src = src.replace(signature_end, "PDL: gl.constexpr = False, times_ptr=None):\n")
    src = src.replace("n_tiles, sm_scale_log2, mask_ptr)", "n_tiles, sm_scale_log2, mask_ptr, times_ptr)")
    src = src.replace("n_tiles, sm_scale_log2, mask_ptr = work", "n_tiles, sm_scale_log2, mask_ptr, times_ptr = work")
    src = _insert(src, r"length = gl\.load\(lens_ptr", "_stamp(times_ptr, 0, pid_s)", after=False)
    src = _insert(src, r"length = gl\.load\(lens_ptr", "_stamp(times_ptr, 1, length)")
    src = _insert(src, r"mbarrier\.wait\(q_bar, 0\)", "_stamp(times_ptr, 2, n_full)")  # _left's
    first = "if i == 0:\n            _stamp(times_ptr, 3, gl.sum(gl.sum(s, 1), 0))"
    src = _insert(src, r"s = _tile_scores\(i, q_lat", first)
    src = _insert(src, r"l_smem\[wg\]\.store\(l_i\)", "if wg == 0:\n        _stamp(times_ptr, 4, gl.sum(l_i, 0))",
                  after=False)
    src = _insert(src, r"mbarrier\.wait\(fin, 0\)", "if wg == 0:\n        _stamp(times_ptr, 5, gl.sum(l_i, 0))")
    src = _insert(src, r"_store_partials\(o, k_lat", "if wg == 0:\n        _stamp(times_ptr, 6, gl.sum(l_safe, 0))")
    head, tail = src.split("\n\n@gluon.jit\ndef _issue_tile", 1)
    extra = GLUON_STAMP + (RELEASE if release_early else "")
    return load_source("stamped_gluon_release" if release_early else "stamped_gluon",
                       head + "\n" + extra + "\n\n@gluon.jit\ndef _issue_tile" + tail)


def load_source(name, src):
    """Module `name` from the source text src, written to a file (Triton's jit reads a kernel's source from it)."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    return ba.module_from_file(path, name)


class Stamped:
    """kernel[grid](...) with times_ptr added (a stand-in for the module global the host code launches)."""

    def __init__(self, kernel, times):
        self.kernel, self.times = kernel, times

    def __getitem__(self, grid):
        self.grid = grid
        return lambda *args, **kwargs: self.kernel[grid](*args, times_ptr=self.times, **kwargs)


def phases(stamps, names):
    """Per-phase (median, max) in us of consecutive stamps, and the programs' (first entry, last end) in ns."""
    ns = stamps[:, :len(names)].double()
    steps = {f"{names[i]}->{names[i + 1]}": ns[:, i + 1] - ns[:, i] for i in range(len(names) - 1)}
    out = {k: (round(v.median().item() / 1e3, 2), round(v.max().item() / 1e3, 2)) for k, v in steps.items()}
    return out, ns[:, 0].min().item(), ns[:, -1].max().item()


def run_case(L, H, T, pad, module, gluon_module=None):
    q, caches, lens, mask = ba.make_inputs(L, H, T, pad=pad)
    split_times = torch.zeros(1 << 16, 32, dtype=torch.int64, device="cuda")
    merge_times = torch.zeros(1 << 16, 32, dtype=torch.int64, device="cuda")
    split = Stamped(module._mla_split_kernel, split_times)
    merge = Stamped(module._merge_kernel, merge_times)
    gluon = gluon_module is not None
    call = lambda kv: mk.mla_attention(q, kv, lens, mask, ba.SCALE, gluon=gluon)  # noqa: E731
    plain_us = ba.graph_time_us(call, caches)
    saved = mk._mla_split_kernel, mk._merge_kernel, mla_gluon._split_kernel
    mk._mla_split_kernel, mk._merge_kernel = split, merge
    if gluon:
        split = mla_gluon._split_kernel = Stamped(gluon_module._split_kernel, split_times)
    try:
        stamped_us = ba.graph_time_us(call, caches)
    finally:
        mk._mla_split_kernel, mk._merge_kernel, mla_gluon._split_kernel = saved
    torch.cuda.synchronize()
    n_split = split.grid[0] * split.grid[1] * split.grid[2]
    s = split_times[:n_split].cpu()
    row = dict(L=L, H=H, T=T, pad=pad, gluon=gluon, grid=list(split.grid), plain_us=round(plain_us, 2),
               stamped_us=round(stamped_us, 2))
    names = GLUON_PHASES if gluon else SPLIT_PHASES
    row["split"], s_first, s_last = phases(s, names)
    end = len(names) - 1
    clk_us = (s[:, 16 + end] - s[:, 16]).double() * 1e-3 / ghz(s, end)
    row["split_program_us_by_clock"] = (round(clk_us.median().item(), 2), round(clk_us.max().item(), 2))
    row["split_entry_spread_us"] = round((s[:, 0].max() - s[:, 0].min()).item() / 1e3, 2)
    row["split_waited_spread_us"] = round((s[:, 1].max() - s[:, 1].min()).item() / 1e3, 2)
    row["split_span_us"] = round((s_last - s_first) / 1e3, 2)
    row["programs_per_sm_max"] = int(torch.bincount(s[:, 15]).max().item())
    if hasattr(merge, "grid"):
        n_merge = merge.grid[0] * merge.grid[1] * merge.grid[2]
        m = merge_times[:n_merge].cpu()
        row["merge"], m_first, m_last = phases(m, MERGE_PHASES)
        row["merge_first_entry_after_split_first_us"] = round((m_first - s_first) / 1e3, 2)
        row["merge_first_waited_after_split_last_end_us"] = round((m[:, 1].min().item() - s_last) / 1e3, 2)
        row["merge_span_after_split_last_end_us"] = round((m_last - s_last) / 1e3, 2)
        row["total_span_us"] = round((m_last - s_first) / 1e3, 2)
    return row


def ghz(stamps, end):
    """The SM clock (GHz) from the programs' own clock64 and globaltimer deltas, entry to the end stamp (slot end)."""
    ns = (stamps[:, end] - stamps[:, 0]).double().sum()
    clk = (stamps[:, 16 + end] - stamps[:, 16]).double().sum()
    return (clk / ns).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gluon", action="store_true", help="stamp the Gluon split kernel (sm_90)")
    parser.add_argument("--release-early", action="store_true",
                        help="with --gluon, also each case with the merge launched early (stamped_gluon_module)")
    parser.add_argument("cases", nargs="+", help="L,H,T[,pad]")
    args = parser.parse_args()
    module = stamped_module()
    variants = [(stamped_gluon_module(), False)] if args.gluon else [(None, False)]
    if args.gluon and args.release_early:
        variants.append((stamped_gluon_module(release_early=True), True))
    rows = []
    for case in args.cases:
        for gluon_module, release_early in variants:
            row = run_case(*ba.parse_case(case), module, gluon_module)
            row["release_early"] = release_early
            rows.append(row)
            print(json.dumps(row), flush=True)
    ba.write_probe_json(args.out, "attention_timeline_gluon.json" if args.gluon else "attention_timeline.json", rows)


if __name__ == "__main__":
    main()
