"""Tuned kernel configs: which file is in force, its validation, and the lookups the kernel modules consult.

A tuned file (JSON, written by `python -m bench.tune`) holds, for one arch, per op the entries in the form of that
op's Python table, chosen per bucket; a bucket whose entry is null (or that the file does not list) takes the
Python default. The file in force for an arch, first found:
1. the file named by `use(path)` (the CLI's --kernel-configs) or the environment variable SPEC_KERNEL_CONFIGS
   ("defaults": the Python tables alone, no file);
2. the package's shipped file for the arch, `triton_kernels/tuned/<arch>.json`, if present;
3. none: the Python tables.
It is loaded and validated at the first lookup (a bad file: one ValueError naming the file and the key) and
announced once on stderr: "kernel configs: FILE (sm_120)". A named file for another arch than the one in force is
refused. Lookups take static shapes and a bucket only, so the CUDA graphs captured per bucket stay valid.

The ops' tables in a file (the `header` says where and how it was made; `measured` keeps the tuner's timings):
- moe: {intermediate: [[max M or null, entry or null], ...]}, entries of moe_configs.CONFIGS' form;
- linear: {"NxK": {M bucket: Config fields as a dict, or "cublas"}} (linear.BUCKETS);
- attention: {"splits": [[max rows or null, max cache entries or null, {tiles, splits, tail_split, partials,
  tma, two_pass} or null], ...], "merge": {splits' power of two: [BLOCK_S, BLOCK_D, warps]}}; two_pass: false (the
  split kernel), true or the two-pass tiles (mla_two_pass.TwoPassTiles as a list);
- tree: [[max budget or null, entry of ddtree.CONFIGS' form or null], ...].
"""

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

ENV_VAR = "SPEC_KERNEL_CONFIGS"
DEFAULTS = "defaults"  # the value that names no file: the Python tables alone
TUNED_DIR = Path(__file__).parent / "tuned"
FORMAT = 1
OPS = ("moe", "linear", "attention", "tree")

_named = None  # the file set by `use`
_loaded = {}  # arch -> (path or None, tables)


def use(path):
    """Take the tuned file `path` ("defaults": none; None: back to the environment variable and the shipped file).
    Takes effect at the next lookup."""
    global _named
    _named = None if path is None else str(path)
    _loaded.clear()


@contextmanager
def overriding(key, tables):
    """The tables `tables` ({op: table}, unvalidated) in force for arch `key` inside the with block (the tuner's
    candidates, tests), then those before."""
    before = _loaded.get(key)
    _loaded[key] = ("<override>", tables)
    try:
        yield
    finally:
        if before is None:
            _loaded.pop(key, None)
        else:
            _loaded[key] = before


def named_file():
    """The file named by `use` or SPEC_KERNEL_CONFIGS (DEFAULTS for none), or None where neither names one."""
    return _named or os.environ.get(ENV_VAR, "").strip() or None


def source(key):
    """The path of the file in force for arch `key`, or None (the Python tables)."""
    named = named_file()
    if named:
        return None if named == DEFAULTS else Path(named)
    shipped = TUNED_DIR / f"{key}.json"
    return shipped if shipped.is_file() else None


def tables(key):
    """{op: table} of the file in force for arch `key` ({} without one), loaded and announced once."""
    if key not in _loaded:
        path = source(key)
        found = load(path, key, named=path is not None and named_file() is not None) if path else {}
        _loaded[key] = (path, found)
        if path:
            print(f"kernel configs: {path} ({key})", file=sys.stderr)
    return _loaded[key][1]


def table(op, key):
    """The tuned table of `op` for arch `key`, or None."""
    return tables(key).get(op)


def load(path, key=None, named=True):
    """The validated {op: table} of the tuned file at `path`, for arch `key` (None: any arch). ValueError in one
    line naming the file and the key that is wrong."""
    where = f"{ENV_VAR}={path}" if named and _named is None else str(path)  # named by the environment
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{where}: cannot read: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON: {err.msg} at line {err.lineno}") from None
    _expect(isinstance(data, dict), where, "", "a JSON object")
    _expect(data.get("format") == FORMAT, where, "format", f"{FORMAT}")
    header = data.get("header")
    _expect(isinstance(header, dict) and isinstance(header.get("arch"), str), where, "header.arch", "an arch key")
    if key is not None and header["arch"] != key:
        raise ValueError(f"{where}: configs for {header['arch']}, but the arch in force is {key} "
                         f"(set SPEC_ARCH={header['arch']} or tune for {key})")
    unknown = set(data) - {"format", "header", "measured", *OPS}
    _expect(not unknown, where, ", ".join(sorted(unknown)), f"one of {', '.join(OPS)}")
    found = {}
    for op in OPS:
        if data.get(op) is not None:
            VALIDATE[op](data[op], where, op)
            found[op] = data[op]
    return found


# ---- lookups (each takes static shapes and a bucket; None: the Python default)


def _first(rows, values):
    """The last item of the first row whose leading bounds (None: unbounded) are >= `values`, or None."""
    for row in rows:
        if all(bound is None or v <= bound for bound, v in zip(row[:-1], values)):
            return row[-1]
    return None


def moe_entry(key, M, intermediate):
    """The tuned MoE entry for M tokens and experts of that intermediate size, or None."""
    found = table("moe", key)
    rows = found.get(str(intermediate)) if found else None
    return _first(rows, (M,)) if rows else None


def moe_layout(key, intermediate):
    """The expert layout (kmajor) that the tuned MoE entries for experts of that intermediate size name, or None."""
    found = table("moe", key)
    layouts = _moe_layouts(found.get(str(intermediate), []) if found else [])
    return layouts.pop() if layouts else None


def _moe_layouts(rows):
    """The layouts (kmajor) that a MoE table's entries name."""
    return {row[-1]["kmajor"] for row in rows if row[-1] and "kmajor" in row[-1]}


def linear_entry(key, N, K, bucket):
    """(listed, entry) of the tuned skinny GEMM for (N, K) at an M bucket: entry a dict of linear.Config's fields,
    or None for cuBLAS; listed False where the file does not say (the Python table decides)."""
    found = table("linear", key)
    shape = found.get(f"{N}x{K}", {}) if found else {}
    if str(bucket) not in shape:
        return False, None
    entry = shape[str(bucket)]
    return True, None if entry == "cublas" else entry


def attention_entry(key, rows, max_len):
    """The tuned attention choices ({tiles, splits, tail_split, partials}) for a query block of `rows` rows over a
    cache of max_len entries, or None."""
    found = table("attention", key)
    return _first(found.get("splits", []), (rows, max_len)) if found else None


def merge_entry(key, splits_block):
    """The tuned merge blocks (BLOCK_S, BLOCK_D, warps) for the splits' power of two, or None."""
    found = table("attention", key)
    entry = found.get("merge", {}).get(str(splits_block)) if found else None
    return tuple(entry) if entry else None


def tree_entry(key, budget):
    """The tuned DDTree config for trees of `budget` nodes, or None."""
    found = table("tree", key)
    return _first(found, (budget,)) if found else None


# ---- validation


def _expect(ok, where, key, what):
    if not ok:
        raise ValueError(f"{where}: {key or 'the file'}: expected {what}")


def _int(v):
    """a positive integer"""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _num(v):
    """a positive number"""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _bool(v):
    """true or false"""
    return isinstance(v, bool)


def _fields(d, spec, required, where, key):
    """d is a dict whose keys are in spec ({name: check}) and include `required`, each value passing its check."""
    _expect(isinstance(d, dict), where, key, "an object")
    for name in required:
        _expect(name in d, where, f"{key}.{name}", "a value (missing)")
    for name, value in d.items():
        _expect(name in spec, where, f"{key}.{name}", f"one of the keys {', '.join(spec)}")
        _expect(spec[name](value), where, f"{key}.{name}", spec[name].__doc__ or "a valid value")


def _optional(check):
    def ok(v):
        return v is None or check(v)

    ok.__doc__ = f"null or {check.__doc__}"
    return ok


def _doc(check, doc):
    check.__doc__ = doc
    return check


_MOE_KERNEL = dict(BN=_int, waves=_num, num_warps=_int, num_stages=_int, maxnreg=_optional(_int), swap=_bool,
                   lop3=_bool, scales_ahead=_bool, prescale=_bool, mma_v2=_bool, device_split=_bool, tiles=_int,
                   persistent=_bool)
_KERNEL_KEYS = ("BN", "waves", "num_warps", "num_stages")
_OBJECT = _doc(lambda v: isinstance(v, dict), "an object")
_MOE = dict(BM=_int, kmajor=_bool, decode=_bool, pdl=_bool, gate_up=_OBJECT, down=_OBJECT)
_LINEAR = dict(kind=_doc(lambda v: v in ("gemv", "dot", "swap"), '"gemv", "dot" or "swap"'), block_n=_int,
               block_k=_int, warps=_int, stages=_int, waves=_num, pdl=_bool, tma=_bool)
_TILES = _doc(lambda v: (isinstance(v, list) and len(v) == 5 and all(_int(x) for x in v[:4]) and _bool(v[4])),
              "[block_m, block_n, warps, stages, unchain]")
_TWO_PASS = _doc(lambda v: _bool(v) or (isinstance(v, list) and len(v) == 8 and all(_int(x) for x in v)),
                 "false, true or the two-pass tiles [scores_m, scores_n, warps, stages, values_m, values_d, warps, "
                 "stages]")
_ATTENTION = dict(tiles=_optional(_TILES), splits=_optional(_int), tail_split=_optional(_bool),
                  partials=_optional(_doc(lambda v: v in ("fp32", "q"), '"fp32" or "q"')), tma=_optional(_bool),
                  two_pass=_optional(_TWO_PASS))
_TOPK_ROW = _doc(lambda v: isinstance(v, list) and len(v) == 5 and all(_int(x) for x in v[:4])
                 and (v[4] is None or _int(v[4])), "[K up to, chunk, warps, scan tile, maxnreg or null]")
_TREE = dict(topk=_doc(lambda v: isinstance(v, list) and v and all(_TOPK_ROW(r) for r in v), "a list of top-k rows "
                       + _TOPK_ROW.__doc__), block_v=_int, warps_v=_int, maxnreg_v=_optional(_int),
             programs_per_sm=_int, unroll_v=_int, build_warps=_int, levels_from=_int, levels_warps=_int)


def _bucket_rows(rows, n_bounds, where, key, check_entry):
    """A list of [bound x n_bounds, entry or null] rows, bounds positive integers or null."""
    _expect(isinstance(rows, list) and rows, where, key, "a non-empty list of buckets")
    for i, row in enumerate(rows):
        _expect(isinstance(row, list) and len(row) == n_bounds + 1, where, f"{key}[{i}]",
                f"[{', '.join(['bound'] * n_bounds)}, entry]")
        for bound in row[:n_bounds]:
            _expect(bound is None or _int(bound), where, f"{key}[{i}]", "bounds that are positive integers or null")
        if row[-1] is not None:
            check_entry(row[-1], where, f"{key}[{i}]")


def _moe_entry(entry, where, key):
    _fields(entry, _MOE, ("BM", "gate_up", "down"), where, key)
    for kernel in ("gate_up", "down"):
        _fields(entry[kernel], _MOE_KERNEL, _KERNEL_KEYS, where, f"{key}.{kernel}")


def _validate_moe(data, where, op):
    _expect(isinstance(data, dict), where, op, "an object {intermediate size: buckets}")
    for size, rows in data.items():
        _expect(size.isdigit(), where, f"{op}.{size}", "an intermediate size (digits)")
        _bucket_rows(rows, 1, where, f"{op}.{size}", _moe_entry)
        _expect(len(_moe_layouts(rows)) <= 1, where, f"{op}.{size}", "entries of one layout (kmajor): the experts "
                                                                      "have one")


def _validate_linear(data, where, op):
    _expect(isinstance(data, dict), where, op, 'an object {"NxK": {bucket: config}}')
    for shape, buckets in data.items():
        parts = shape.split("x")
        _expect(len(parts) == 2 and all(p.isdigit() for p in parts), where, f"{op}.{shape}", 'a shape "NxK"')
        _expect(isinstance(buckets, dict), where, f"{op}.{shape}", "an object {M bucket: config}")
        for bucket, entry in buckets.items():
            _expect(bucket.isdigit(), where, f"{op}.{shape}.{bucket}", "an M bucket (digits)")
            if entry != "cublas":
                _fields(entry, _LINEAR, ("kind", "block_n", "block_k", "warps", "stages", "waves"), where,
                        f"{op}.{shape}.{bucket}")


def _validate_attention(data, where, op):
    _fields(data, dict(splits=_doc(lambda v: True, ""), merge=_OBJECT), (), where, op)
    if "splits" in data:
        _bucket_rows(data["splits"], 2, where, f"{op}.splits",
                     lambda entry, where, key: _fields(entry, _ATTENTION, (), where, key))
    for block, entry in data.get("merge", {}).items():
        _expect(block.isdigit() and isinstance(entry, list) and len(entry) == 3 and all(_int(x) for x in entry),
                where, f"{op}.merge.{block}", "[BLOCK_S, BLOCK_D, warps] under a power of two")


def _validate_tree(data, where, op):
    _bucket_rows(data, 1, where, op, lambda entry, where, key: _fields(entry, _TREE, tuple(_TREE), where, key))


VALIDATE = dict(moe=_validate_moe, linear=_validate_linear, attention=_validate_attention, tree=_validate_tree)
