"""The tuner (bench/tune.py) and the tuned files the kernels load (triton_kernels/tuning.py), on tiny shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TRITON_DEVICE, requires_triton
from triton_kernels import arch, linear, tuning

tune = pytest.importorskip("bench.tune")


@pytest.fixture(autouse=True)
def no_tuned_file(monkeypatch, tmp_path):
    """Each test starts with no tuned file in force (no environment variable, an empty shipped folder)."""
    monkeypatch.delenv(tuning.ENV_VAR, raising=False)
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path / "shipped")
    tuning.use(None)
    yield
    tuning.use(None)


def few_candidates(monkeypatch, tuner, n):
    """The tuner's candidates cut to its first n per bucket (the interpreter is slow)."""
    full = tuner.candidates
    monkeypatch.setattr(tuner, "candidates", lambda self, info: full(self, info)[:n])


def tuned_file(tmp_path, key, **ops):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(dict(format=tuning.FORMAT, header=dict(arch=key), **ops)))
    return path


@requires_triton
def test_tuner_writes_a_valid_file_and_resumes(monkeypatch, tmp_path, capsys):
    """End to end on the skinny GEMM: every bucket measured (the default first), a file the loader accepts; a rerun
    with the same --out measures nothing again, and after a bucket is dropped from the file, that bucket alone."""
    few_candidates(monkeypatch, tune.LinearTuner, 2)
    out = tmp_path / "t.json"
    argv = ["--ops", "linear", "--shapes", "tiny", "--reps", "5", "--out", str(out)]
    assert tune.main(argv) == 0
    data = json.loads(out.read_text())
    key = arch.current()
    assert data["header"]["arch"] == key and {"gpu", "triton", "torch", "date", "command"} <= set(data["header"])
    buckets = [name for name, _ in tune.LinearTuner(key, True).buckets()]
    assert sorted(data["measured"]["linear"]) == sorted(buckets)
    for record in data["measured"]["linear"].values():
        assert "default" in record["candidates"] and record["best_us"] <= record["default_us"]
    assert set(tuning.load(out, key)) <= {"linear"}
    assert "default us" in capsys.readouterr().out

    measured = []
    real = tune.measure
    monkeypatch.setattr(tune, "measure", lambda tuner, name, *a: measured.append(name) or real(tuner, name, *a))
    assert tune.main(argv) == 0
    assert measured == []
    data["measured"]["linear"].pop(buckets[-1])
    out.write_text(json.dumps(data))
    assert tune.main(argv) == 0
    assert measured == [buckets[-1]]
    assert sorted(json.loads(out.read_text())["measured"]["linear"]) == sorted(buckets)
    measured.clear()
    assert tune.main(argv + ["--fresh"]) == 0  # every bucket again
    assert sorted(measured) == sorted(buckets)


@requires_triton
def test_a_file_from_another_gpu_keeps_the_other_ops_tables_and_says_so(monkeypatch, tmp_path):
    """--out naming a file tuned on another GPU: the ops tuned now are measured afresh, the others' tables are kept,
    and the header names where those were tuned."""
    few_candidates(monkeypatch, tune.LinearTuner, 1)
    key = arch.current()
    tree = [[None, None]]
    out = tmp_path / "t.json"
    out.write_text(json.dumps(dict(format=tuning.FORMAT, tree=tree, linear={"64x256": {"1": "cublas"}},
                                   header=dict(arch=key, gpu="Another GPU", triton="0.1", date="then"),
                                   measured=dict(linear={"64x256/M1": {}}))))
    measured = []
    real = tune.measure
    monkeypatch.setattr(tune, "measure", lambda tuner, name, *a: measured.append(name) or real(tuner, name, *a))
    assert tune.main(["--ops", "linear", "--shapes", "tiny", "--reps", "5", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "64x256/M1" in measured and data["tree"] == tree
    assert data["header"]["carried"] == {"tree": "Another GPU, 0.1, then"}
    assert set(tuning.load(out, key)) == {"linear", "tree"}


@requires_triton
def test_wrong_candidate_is_rejected(monkeypatch, tmp_path):
    """A candidate whose kernel returns a wrong result (zeros, at once: the fastest) fails the reference check and
    is never chosen."""
    wrong = linear.Config("gemv", 16, 256, 4, 3, 1)
    real = linear.linear_kernel
    monkeypatch.setattr(linear, "linear_kernel", lambda x, w, cfg=None, raw=False: (
        torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) if cfg == wrong else real(x, w, cfg, raw)))
    monkeypatch.setattr(tune.LinearTuner, "candidates", lambda self, info: [
        ("wrong", wrong._asdict()), ("gemv", linear.Config("gemv", 32, 256, 4, 3, 2)._asdict())])
    monkeypatch.setattr(tune.LinearTuner, "__init__", lambda self, key, tiny: (
        setattr(self, "key", key), setattr(self, "tiny", tiny), setattr(self, "shapes", [(64, 256)]),
        setattr(self, "ms", (1,)), setattr(self, "cases", {})) and None)
    out = tmp_path / "t.json"
    assert tune.main(["--ops", "linear", "--shapes", "tiny", "--reps", "5", "--out", str(out)]) == 0
    record = json.loads(out.read_text())["measured"]["linear"]["64x256/M1"]
    assert record["candidates"]["wrong"].startswith("rejected: rel. error")
    assert record["chosen"] != "wrong" and "gemv" in record["candidates"]


def test_linear_candidates_start_with_sm90s_entry_on_another_arch():
    """On sm_120 the skinny GEMM's candidates start, after cuBLAS, with sm_90's adopted entry for the shape and
    bucket (once, even where it is one of the kernel's own forms); on sm_90 they are the forms alone."""
    info = dict(N=512, K=7168, M=1)
    hopper = linear.ADOPTED["sm_90"][512, 7168][1]
    names, entries = zip(*tune.LinearTuner("sm_120", False).candidates(info))
    assert names[0] == "cublas" and entries[1] == hopper._asdict() and entries.count(hopper._asdict()) == 1
    assert len(names) == len(tune.LinearTuner.GEMV) + 1  # it is one of the forms
    own = [entry for _, entry in tune.LinearTuner("sm_90", False).candidates(dict(N=7168, K=43008, M=2))]
    assert own == ["cublas"] + [linear.Config(*form)._asdict() for form in tune.LinearTuner.DOT]
    first = tune.LinearTuner("sm_120", False).candidates(dict(N=2112, K=7168, M=2))[1][1]
    assert first == linear.ADOPTED["sm_90"][2112, 7168][2]._asdict()


@requires_triton
def test_tuned_linear_entry_runs_in_place_of_the_table(monkeypatch, tmp_path, capsys):
    """SPEC_KERNEL_CONFIGS names a file: the skinny GEMM launches with its config for that shape and bucket, cuBLAS
    where it says "cublas", the Python table elsewhere; the file in force is announced once."""
    key = arch.current()
    cfg = linear.Config("gemv", 16, 256, 4, 3, 1)
    path = tuned_file(tmp_path, key, linear={"64x256": {"1": cfg._asdict(), "2": "cublas"}})
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    used = []
    real = linear.linear_kernel
    monkeypatch.setattr(linear, "linear_kernel", lambda x, w, cfg=None: used.append(cfg) or real(x, w, cfg))
    dev = torch.device(TRITON_DEVICE)
    w = torch.randn(64, 256, device=dev).half()
    out = linear.linear(torch.randn(1, 256, device=dev).half(), w)
    assert used == [cfg] and torch.isfinite(out).all()
    linear.linear(torch.randn(2, 256, device=dev).half(), w)
    assert used == [cfg]  # cuBLAS
    assert linear.adopted(dev, 2, 2112, 7168) == linear.ADOPTED[key].get((2112, 7168), {}).get(2)
    err = capsys.readouterr().err
    assert err.count("kernel configs:") == 1 and f"kernel configs: {path} ({key})" in err


@requires_triton
def test_tuned_moe_entry_runs_in_place_of_the_table(monkeypatch, tmp_path):
    """The MoE launches its kernels with the tuned entry of M's bucket for experts of that intermediate size (the
    entry a file gives, not the table's), and the result still matches the reference."""
    from ops.moe import PackedExperts, moe_torch
    from tests.test_moe_kernel import make_experts, make_routing
    from triton_kernels import moe_configs, moe_layout, moe_w4a16

    key = arch.current()
    kernel = dict(BN=32, waves=1, num_warps=4, num_stages=2)
    entry = dict(BM=16, kmajor=moe_configs.KMAJOR[key], gate_up=kernel, down=dict(kernel, BN=64))
    path = tuned_file(tmp_path, key, moe={"64": [[2, entry], [None, None]]})
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    seen = []
    real = moe_w4a16.gate_up
    monkeypatch.setattr(moe_w4a16, "gate_up", lambda *a: seen.append(a[7]) or real(*a))
    raw = make_experts(4, 256, 64)
    ids, weights = make_routing(2, 4, 2)
    x = torch.randn(2, 256, device=ids.device).half()
    out = moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw))
    assert seen == [kernel]
    assert ((out.float() - moe_torch(x.float(), ids, weights, PackedExperts(*raw))).norm()
            / moe_torch(x.float(), ids, weights, PackedExperts(*raw)).norm()) < 1e-2
    assert moe_configs.config_for(torch.device("cpu"), 3, intermediate=64) == moe_configs.config_for(
        torch.device("cpu"), 3, intermediate=256)  # past the bucket: the table's


def test_moe_table_keeps_each_shape_to_the_layout_whose_buckets_sum_lower():
    """Per shape one layout: the one whose buckets' best times sum lower, even where a bucket's overall winner is
    in the other, unless it is slower than the default (here: the slab layout's) in some bucket; each bucket then
    takes its fastest entry in that layout."""
    tuner = tune.MoeTuner(arch.current(), True)
    slab, kmajor = (dict(BM=8, kmajor=k, gate_up={}, down={}) for k in (False, True))
    fast_slab = dict(slab, BM=16)

    def record(slab_us, kmajor_us, default_us):
        best = fast_slab if slab_us < kmajor_us else kmajor
        return dict(entry=best, default_us=default_us, default_group="slab",
                    by_group=dict(slab=dict(us=slab_us, entry=fast_slab), kmajor=dict(us=kmajor_us, entry=kmajor)))

    names = [name for name, _ in tuner.buckets()]
    measured = {names[0]: record(10.0, 11.0, 12.0), names[1]: record(30.0, 20.0, 30.0)}
    assert tuner.table(measured) == {"64": [[2, kmajor], [None, kmajor]]}
    measured[names[0]] = record(10.0, 11.0, 10.5)  # K-major slower than the default at M <= 2
    assert tuner.table(measured) == {"64": [[2, fast_slab], [None, fast_slab]]}
    measured = {names[0]: record(10.0, 11.0, 12.0), names[1]: record(30.0, 29.5, 30.0)}
    assert tuner.table(measured) == {"64": [[2, fast_slab], [None, fast_slab]]}
    measured = {names[0]: record(12.0, 11.0, 12.0), names[1]: record(30.0, 20.0, 30.0)}
    measured[names[0]]["by_group"].pop("kmajor")  # no K-major candidate timed there: the default's layout
    assert tuner.table(measured) == {"64": [[2, fast_slab], [None, fast_slab]]}
    assert tuner.table({names[1]: record(30.0, 20.0, 30.0)}) == {"64": [[2, None], [None, kmajor]]}
    assert tuner.notes(measured) == [f"moe tiny: the table keeps the slab layout, each bucket its fastest entry "
                                     f"there; left out: kmajor: untimed in {names[0]}"]


class GroupedTuner:
    """A tuner of entries {"group", "us"} whose calls do nothing: measure's scheduling alone."""

    op = "grouped"

    def __init__(self, candidates):
        self.listed = candidates

    def reference(self, info):
        return None

    def default(self, info):
        return dict(group="slab", us=100)

    def candidates(self, info):
        return self.listed

    def run(self, info, entry, reference):
        return None, [entry["us"]]  # "timed" by `fake_times`

    def fit_key(self, info, entry):
        return None

    def group(self, entry):
        return entry["group"]


def fake_times(monkeypatch):
    """time_us reads each entry's "us" (GroupedTuner's calls)."""
    monkeypatch.setattr(tune, "time_us", lambda calls, reps: float(calls[0]))


def measure_grouped(listed, end=1e18, margin=0.0):
    bar = type("Bar", (), {"set_postfix_str": lambda self, text: None})()
    return tune.measure(GroupedTuner(listed), "b", {}, end=end, left=1, reps=5, margin=margin, fits={}, bar=bar)


def test_the_defaults_layout_keeps_the_default_unless_beaten_by_the_margin(monkeypatch):
    """A table may keep to the default's layout while the overall winner is in the other: there the layout's best
    replaces the default only where it wins by the margin, as the winner must."""
    fake_times(monkeypatch)
    kmajor = ("kmajor", dict(group="kmajor", us=50))
    close = measure_grouped([("slab", dict(group="slab", us=99)), kmajor], margin=0.02)
    assert close["by_group"]["slab"]["label"] == "default" and close["by_group"]["kmajor"]["label"] == "kmajor"
    ahead = measure_grouped([("slab", dict(group="slab", us=90)), kmajor], margin=0.02)
    assert ahead["by_group"]["slab"]["label"] == "slab"


def test_each_layout_gets_a_time_in_a_bucket_whose_share_is_spent(monkeypatch):
    """With no time left, a bucket still times the first candidate of each group the default is not in (a
    shape's table keeps to one layout, so a layout untimed in one bucket could not be chosen for any), and no
    other."""
    fake_times(monkeypatch)
    listed = [(f"{group}{i}", dict(group=group, us=i)) for group in ("slab", "kmajor") for i in (1, 2)]
    record = measure_grouped(listed, end=0.0)
    notes = record["candidates"]
    assert set(record["by_group"]) == {"slab", "kmajor"} and isinstance(notes["kmajor1"], float)
    assert notes["slab1"] == notes["slab2"] == notes["kmajor2"] == "not started: budget spent"


@requires_triton
def test_moe_tuner_writes_one_layout_the_experts_then_get(monkeypatch, tmp_path):
    """End to end on tiny MoE shapes, a candidate in each layout: every bucket's entry in the file is in one
    layout, the loader accepts it, and `prepare_moe` lays the experts out in it."""
    from tests.test_moe_kernel import make_experts
    from triton_kernels import moe_configs, moe_layout

    full = tune.MoeTuner.candidates
    monkeypatch.setattr(tune.MoeTuner, "candidates", lambda self, info: [
        next(c for c in full(self, info) if c[1]["kmajor"] == k) for k in (False, True)])
    out = tmp_path / "t.json"
    assert tune.main(["--ops", "moe", "--shapes", "tiny", "--reps", "5", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["moe"]["64"]
    layouts = {entry["kmajor"] for _, entry in rows}
    assert len(layouts) == 1 and all(len(r["by_group"]) == 2 for r in data["measured"]["moe"].values())
    monkeypatch.setenv(tuning.ENV_VAR, str(out))
    tuning.use(None)
    assert moe_layout.prepare_moe(*make_experts(4, 256, 64)).kmajor == layouts.pop()
    assert moe_configs.config_for(torch.device("cpu"), 1, 64) == rows[0][1]


def test_tuned_attention_and_tree_entries_are_looked_up_per_bucket(monkeypatch, tmp_path):
    """Attention: the tuned split count and tiles where the rows and cache length fall in the bucket; the merge's
    blocks; DDTree: the tuned config for budgets in its bucket, CONFIGS' past it."""
    from triton_kernels import ddtree, mla_attention

    key = arch.current()
    tree = dict(ddtree.CONFIGS[key], topk=[[512, 2048, 8, 2048, None]], block_v=1024)
    path = tuned_file(tmp_path, key, tree=[[16, tree], [None, None]], attention=dict(
        splits=[[16, 4096, dict(splits=3, tiles=[16, 32, 4, 2, False])], [None, None, None]],
        merge={"8": [8, 64, 4]}))
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    q = torch.empty(1, 2, 8, 576, dtype=torch.float16)
    p = mla_attention.plan(q, torch.empty(1, 4000, 576, dtype=torch.float16), causal=False)
    assert p.splits == 3 and p.entry.tiles == mla_attention.Tiles(16, 32, 4, 2, False)
    longer = mla_attention.plan(q, torch.empty(1, 5000, 576, dtype=torch.float16), causal=False)
    assert longer.entry.tiles == mla_attention.entry_for(16, key).tiles  # past the bucket: the tables'
    assert mla_attention.merge_blocks(7, key) == (8, 64, 4)
    assert mla_attention.merge_blocks(16, key) == mla_attention.MERGE_BLOCKS[16]
    assert ddtree.config_for(torch.device("cpu"), 16) == tree
    assert ddtree.config_for(torch.device("cpu"), 17) is ddtree.CONFIGS[key]
    chunk = ddtree.topk_plan(163840, 16, ddtree.config_for(torch.device("cpu"), 16))[0]
    assert chunk == 2048


def test_attention_default_leaves_the_split_count_to_the_model_unless_a_file_pins_it(monkeypatch, tmp_path):
    """A bucket spans many cache lengths, so the default the tuner writes where nothing beats it keeps the split
    model's per-length count (None), and its split candidates start from the count the model gives at the timed
    length; a file in force that pins a count keeps it."""
    key = arch.current()
    tuner = tune.AttentionTuner(key, True)
    _, info = tuner.buckets()[0]
    assert tuner.default(info)["splits"] is None
    model = tuner.plan(info).splits
    counts = {entry["splits"] for label, entry in tuner.candidates(info) if label.startswith("splits")}
    assert counts and model not in counts and all(c in (max(1, model // 2), model * 2, max(1, model * 3 // 4),
                                                        model * 3 // 2) for c in counts)
    path = tuned_file(tmp_path, key, attention=dict(splits=[[None, None, dict(splits=model + 1)]]))
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    tuning.use(None)
    assert tuner.default(info)["splits"] == model + 1


def test_attention_tuner_times_the_two_pass_kernels_and_the_split_kernel(monkeypatch, tmp_path):
    """On sm_120 a tree of 136 rows runs the two-pass kernels by default: the tuner's default says so, its candidates
    are other two-pass tiles and the split kernel (pinned by two_pass false, since the rule would pick the
    two-pass kernels), each checked against the reference; a file entry naming two-pass tiles is what runs."""
    from triton_kernels import mla_attention, mla_two_pass

    monkeypatch.setenv(tuning.ENV_VAR, "defaults")
    tuning.use(None)
    with arch.using("sm_120"):
        tuner = tune.AttentionTuner("sm_120", True)
        info = dict(kind="split", T=17, L=96, bound=None)
        base = tuner.default(info)
        assert base["two_pass"] == list(mla_attention.TWO_PASS["sm_120"][1]) and base["splits"] is None
        candidates = dict(tuner.candidates(info))
        assert candidates["split kernel"]["two_pass"] is False
        assert all(e["two_pass"] is False for label, e in candidates.items() if label.startswith("tiles"))
        assert {tuple(e["two_pass"]) for label, e in candidates.items() if label.startswith("two-pass")} == set(
            tune.AttentionTuner.TWO_PASS_FORMS)
        small = dict(two_pass=[16, 16, 4, 1, 16, 256, 4, 1], splits=2, partials="q")
        for entry in (small, candidates["split kernel"]):
            failed, calls = tuner.run(info, entry, tuner.reference(info))
            assert failed is None and len(calls) == 1
        path = tuned_file(tmp_path, "sm_120", attention=dict(splits=[[None, None, small]]))
        monkeypatch.setenv(tuning.ENV_VAR, str(path))
        tuning.use(None)
        p = tuner.plan(info)
        assert p.two_pass == (16, 16, 4, 1, 16, 256, 4, 1) and p.splits == 2
        assert tuner.default(info)["splits"] == 2
        named = tuner.plan(info, mla_attention.Config(tiles=mla_attention.Tiles(16, 32, 4, 2, False)))
        assert named.two_pass is None and named.entry.tiles.block_n == 32  # a caller's tiles beat the file
        split_entry = dict(candidates["split kernel"], splits=7)
        path.write_text(json.dumps(dict(format=tuning.FORMAT, header=dict(arch="sm_120"),
                                        attention=dict(splits=[[None, None, split_entry]]))))
        tuning.use(None)
        assert tuner.plan(info).two_pass is None and tuner.plan(info).splits == 7
        asked = tuner.plan(info, mla_attention.Config(two_pass=True))  # the file's count is the split kernel's
        min_rows, tiles, per_sm = mla_attention.TWO_PASS["sm_120"]
        model = mla_two_pass.default_splits(tiles, 17 * 8, 1, 96, arch.sm_count(tune.device()), per_sm)
        assert asked.two_pass == tiles and asked.splits == model != 7


def test_defaults_and_shipped_file(monkeypatch, tmp_path):
    """Without a named file the shipped file for the arch is in force; SPEC_KERNEL_CONFIGS=defaults (or
    tuning.use("defaults")) runs the Python tables."""
    key = arch.current()
    shipped = tuning.TUNED_DIR
    shipped.mkdir()
    (shipped / f"{key}.json").write_text(json.dumps(dict(format=1, header=dict(arch=key), linear={
        "64x256": {"1": "cublas"}})))
    assert tuning.source(key) == shipped / f"{key}.json" and tuning.linear_entry(key, 64, 256, 1) == (True, None)
    monkeypatch.setenv(tuning.ENV_VAR, "defaults")
    tuning.use(None)
    assert tuning.source(key) is None and tuning.linear_entry(key, 64, 256, 1) == (False, None)


@pytest.mark.parametrize("content,message", [
    ("{not json", "not JSON"),
    (dict(format=1, header=dict(arch="sm_120" if arch.current() != "sm_120" else "sm_90")), "but the arch in force"),
    (dict(format=1, header=dict(arch="ARCH"), linear={"64x256": {"1": dict(kind="gemv", block_n="wide", block_k=256,
                                                                            warps=4, stages=3, waves=1)}}),
     "linear.64x256.1.block_n: expected a positive integer"),
    (dict(format=1, header=dict(arch="ARCH"), moe={"256": [[1, dict(BM=8, gate_up={}, down={})]]}),
     "moe.256[0].gate_up.BN: expected a value (missing)"),
    (dict(format=1, header=dict(arch="ARCH"), tree=[[8, dict(block_v=1024)]]), "tree[0].topk: expected a value"),
    (dict(format=1, header=dict(arch="ARCH"), atention={}), "atention: expected one of moe, linear"),
    (dict(format=2, header=dict(arch="ARCH")), "format: expected 1"),
], ids=["json", "arch", "type", "missing", "tree", "op", "format"])
def test_bad_file_gives_one_line(monkeypatch, tmp_path, content, message):
    key = arch.current()
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content).replace("ARCH", key))
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    with pytest.raises(ValueError) as err:
        linear.adopted(torch.device("cpu"), 1, 64, 256)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{tuning.ENV_VAR}={path}: ") and message in text, text


def test_tuner_cli_refuses_a_bad_file(tmp_path):
    """The tuner with a bad file in force: one line `error: ...`, exit code 2, no traceback."""
    path = tmp_path / "bad.json"
    path.write_text("[]")
    root = Path(__file__).parent.parent
    env = dict(os.environ, **{tuning.ENV_VAR: str(path), "PYTHONPATH": f"{root / 'src'}:{root}"})
    proc = subprocess.run([sys.executable, "-m", "bench.tune", "--ops", "linear", "--shapes", "tiny", "--out",
                           str(tmp_path / "t.json")], capture_output=True, text=True, env=env, timeout=120, cwd=root)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {tuning.ENV_VAR}={path}: the file: expected a JSON object"], proc.stderr


@pytest.mark.parametrize("command", ["decode", "serve"])
def test_commands_refuse_a_bad_kernel_configs_flag(tmp_path, command):
    """--kernel-configs of spec.decode and spec.serve: a bad file is a usage error naming the flag, at parse time."""
    import importlib

    from spec.decode import UsageError

    path = tmp_path / "bad.json"
    path.write_text("[]")
    parse = importlib.import_module(f"spec.{command}").parse_args
    prompt = ["--prompt", "x"] if command == "decode" else []
    with pytest.raises(UsageError, match=f"^--kernel-configs: {path}: the file: expected a JSON object$"):
        parse([*prompt, "--device", "cpu", "--kernel-configs", str(path)])
