"""K2.6-format checkpoint writer and streaming loader: round trips, layouts, TP slices and clear errors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ops
from model import checkpoint, checkpoint_writer
from model.checkpoint import INDEX_FILE, checkpoint_entries, load_model, quantize_int4
from model.checkpoint_writer import random_tensors, write_checkpoint
from model.config import preset
from model.parallel import Parallel
from tests.test_model_vs_hf import one_thread  # noqa: F401 (autouse fixture)

CFG = preset("tiny")
SHARD = 300_000


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CFG, seed=1)


@pytest.fixture
def ckpt(tmp_path, tensors):
    write_checkpoint(tmp_path / "ckpt", CFG, tensors, shard_size_bytes=SHARD)
    return tmp_path / "ckpt"


def weight_map(path):
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def edit(path, name, tensor=None, new_name=None):
    """Replace (or with tensor=None, delete) one tensor of a sharded checkpoint in place."""
    index = json.loads((path / INDEX_FILE).read_text())
    file = path / index["weight_map"][name]
    stored = load_file(file)
    del stored[name]
    if tensor is None:
        del index["weight_map"][name]
    else:
        stored[new_name or name] = tensor
        index["weight_map"][new_name or name] = file.name
    save_file(stored, file)
    (path / INDEX_FILE).write_text(json.dumps(index))


def test_quantize_int4_is_symmetric_group32():
    w = torch.randn(6, 96) * torch.logspace(-3, 0, 6)[:, None]
    w[2, 32:64] = 0
    packed, scale, deq = quantize_int4(w)
    assert packed.dtype == torch.int32 and packed.shape == (6, 12) and scale.shape == (6, 3)
    assert scale.dtype == torch.bfloat16 and scale[2, 1] == 1 and (deq[2, 32:64] == 0).all()
    assert torch.equal(deq, ops.unpack_int4(packed, scale))
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((w - deq).abs() <= step / 2 + 1e-7).all()
    q = torch.round(deq / step)
    assert q.min() >= -7 and q.max() <= 7 and q.abs().amax(1).min() == 7  # absmax / 7: -8 unused
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_int4(torch.randn(2, 40))


def test_roundtrip_gives_back_the_exact_packed_ints_and_scales(ckpt, tensors):
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    experts = model.layers[1].mlp.experts
    I = CFG.moe_intermediate_size
    for e in (0, CFG.n_routed_experts - 1):
        stem = f"model.layers.1.mlp.experts.{e}."
        parts = {p: quantize_int4(tensors[stem + f"{p}_proj.weight"]) for p in ("gate", "up", "down")}
        assert torch.equal(experts.gate_up_packed[e, :I], parts["gate"][0])
        assert torch.equal(experts.gate_up_packed[e, I:], parts["up"][0])
        assert torch.equal(experts.gate_up_scale[e, I:], parts["up"][1])
        assert torch.equal(experts.down_packed[e], parts["down"][0])
        assert torch.equal(experts.down_scale[e], parts["down"][1])
    attn = model.layers[0].self_attn
    assert torch.equal(attn.kv_b_proj.weight, tensors["model.layers.0.self_attn.kv_b_proj.weight"].bfloat16().float())
    bias = model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, tensors["model.layers.2.mlp.gate.e_score_correction_bias"])  # fp32 kept exactly
    floats = [n for n, b in model.named_buffers() if b.is_floating_point() and b.isnan().any()]
    assert floats == []  # every (NaN-filled) buffer was loaded


def test_on_disk_format(ckpt):
    wm = weight_map(ckpt)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    files = sorted(set(wm.values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    total, dtypes = 0, {}
    for file in files:
        with safe_open(str(ckpt / file), "pt") as f:
            sizes = [f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys()]
            assert sum(sizes) <= SHARD or len(sizes) == 1
            total += sum(sizes)
            dtypes.update({n: f.get_slice(n).get_dtype() for n in f.keys()})
    assert index["metadata"]["total_size"] == total and set(wm) == set(dtypes)
    stem = "language_model.model.layers.1.mlp.experts.7.down_proj.weight_"
    assert [dtypes[stem + p] for p in ("packed", "scale", "shape")] == ["I32", "BF16", "I32"]
    assert dtypes["language_model.model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert dtypes["language_model.lm_head.weight"] == "BF16"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["text_config"]["model_type"] == "kimi_k2"
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    with safe_open(str(ckpt / wm[stem + "shape"]), "pt") as f:
        assert f.get_tensor(stem + "shape").tolist() == [CFG.hidden_size, CFG.moe_intermediate_size]


def test_single_file_and_flat_prefix_load_the_same(tmp_path, tensors, ckpt):
    write_checkpoint(tmp_path / "single", CFG, tensors, single_file=True)
    write_checkpoint(tmp_path / "flat", CFG, tensors, prefix="", shard_size_bytes=SHARD)
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["config.json", "model.safetensors"]
    flat = json.loads((tmp_path / "flat" / "config.json").read_text())
    assert "text_config" not in flat and flat["quantization_config"]["format"] == "pack-quantized"
    assert "model.layers.0.mlp.gate_proj.weight" in weight_map(tmp_path / "flat")
    ref = dict(load_model(ckpt, progress=False).named_buffers())
    for name in ("single", "flat"):
        got = dict(load_model(tmp_path / name, progress=False).named_buffers())
        assert all(torch.equal(got[k], ref[k]) for k in ref), name


def test_ignores_vision_tower_projector_and_inv_freq(ckpt):
    extra = {"vision_tower.blocks.0.attn.weight": torch.ones(3, 3), "mm_projector.proj.weight": torch.ones(2),
             "language_model.model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}
    save_file(extra, ckpt / "model-vision.safetensors")
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"].update({n: "model-vision.safetensors" for n in extra})
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    load_model(ckpt, progress=False)


def test_tp_ranks_load_their_slices(ckpt):
    full = dict(load_model(ckpt, dtype=torch.float32, progress=False).named_buffers())
    H, qk, v, I = CFG.num_attention_heads // 2, CFG.qk_head_dim, CFG.v_head_dim, CFG.moe_intermediate_size // 2
    D = CFG.intermediate_size // 2
    for r in range(2):
        part = dict(load_model(ckpt, Parallel(2, r), dtype=torch.float32, progress=False).named_buffers())
        a = "layers.0.self_attn."
        assert torch.equal(part[a + "q_b_proj.weight"], full[a + "q_b_proj.weight"][r * H * qk : (r + 1) * H * qk])
        assert torch.equal(part[a + "o_proj.weight"], full[a + "o_proj.weight"][:, r * H * v : (r + 1) * H * v])
        assert torch.equal(part[a + "kv_a_proj_with_mqa.weight"], full[a + "kv_a_proj_with_mqa.weight"])
        gu = full["layers.0.mlp.gate_up.weight"]
        assert torch.equal(part["layers.0.mlp.gate_up.weight"],
                           torch.cat([gu[r * D : (r + 1) * D], gu[2 * D :][r * D : (r + 1) * D]]))
        e = "layers.1.mlp.experts."
        gate_up = ops.unpack_int4(full[e + "gate_up_packed"], full[e + "gate_up_scale"])
        down = ops.unpack_int4(full[e + "down_packed"], full[e + "down_scale"])
        rows = torch.cat([torch.arange(r * I, (r + 1) * I), 2 * I + torch.arange(r * I, (r + 1) * I)])
        assert torch.equal(ops.unpack_int4(part[e + "gate_up_packed"], part[e + "gate_up_scale"]), gate_up[:, rows])
        assert torch.equal(ops.unpack_int4(part[e + "down_packed"], part[e + "down_scale"]),
                           down[..., r * I : (r + 1) * I])
        V = CFG.vocab_size // 2
        assert torch.equal(part["lm_head.weight"], full["lm_head.weight"][r * V : (r + 1) * V])


BODY = "language_model.model."


@pytest.mark.parametrize("name, tensor, message", [
    (BODY + "layers.0.self_attn.kv_b_proj.weight", None, r"tensors missing .*kv_b_proj"),
    (BODY + "layers.0.self_attn.kv_b_proj.weight", torch.zeros(5, 512, dtype=torch.bfloat16),
     r"kv_b_proj.weight has shape \(5, 512\), expected \(256, 512\)"),
    (BODY + "norm.weight", torch.zeros(128, dtype=torch.int32), r"norm.weight has dtype I32, expected BF16 or F16"),
    (BODY + "layers.2.mlp.experts.3.up_proj.weight_packed", torch.zeros(64, 16),
     r"experts.3.up_proj.weight_packed has dtype F32, expected I32"),
    (BODY + "layers.2.mlp.experts.3.up_proj.weight_scale", torch.zeros(64, 4),
     r"weight_scale has dtype F32, expected BF16"),
    (BODY + "layers.2.mlp.experts.3.up_proj.weight_shape", torch.tensor([64, 64], dtype=torch.int32),
     r"experts.3.up_proj.weight_shape is \[64, 64\], expected \[64, 128\]"),
], ids=["missing", "shape", "dtype", "packed-dtype", "scale-dtype", "weight-shape"])
def test_bad_tensors_raise_naming_them(ckpt, name, tensor, message):
    edit(ckpt, name, tensor)
    with pytest.raises(ValueError, match=message):
        load_model(ckpt, progress=False)


def test_bad_shape_in_the_last_shard_fails_before_reading_data(ckpt, monkeypatch):
    last = max(weight_map(ckpt).items(), key=lambda item: item[1])[0]
    edit(ckpt, last, torch.zeros(1, dtype=torch.bfloat16))
    monkeypatch.setattr(checkpoint, "_load_file", lambda *a: pytest.fail("data read before validation"))
    with pytest.raises(ValueError, match=f"{last} has shape \\(1,\\)"):
        load_model(ckpt, progress=False)


def test_bad_files_and_configs_raise(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{shard.name} is not a readable safetensors file"):
        load_model(ckpt, progress=False)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {shard.name}, which does not exist"):
        load_model(ckpt, progress=False)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match='quantization_config.quant_method "awq" is not supported'):
        load_model(ckpt, progress=False)
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only compressed-tensors pack-quantized"):
        load_model(ckpt, progress=False)
    (ckpt / "config.json").write_text('{"text_config": {')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(ckpt, progress=False)
    (ckpt / "config.json").write_text(json.dumps(CFG.to_hf()))
    (ckpt / INDEX_FILE).write_text("{}")
    with pytest.raises(ValueError, match="has no weight_map"):
        load_model(ckpt, progress=False)


def test_writer_refuses_and_leaves_nothing_on_failure(tmp_path, tensors, monkeypatch):
    with pytest.raises(ValueError, match="tensors missing for this config"):
        write_checkpoint(tmp_path / "a", CFG, {k: v for k, v in tensors.items() if "norm" not in k})
    bad = dict(tensors, **{"model.norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(7,\), expected \(128,\)"):
        write_checkpoint(tmp_path / "a", CFG, bad)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        write_checkpoint(tmp_path / "b", CFG, tensors)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_writer, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path / "c", CFG, tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_entries_cover_every_model_buffer():
    names = set(checkpoint_entries(preset("tiny-grouped")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any("q_a_proj" in n for n in names)
    assert len([n for n in names if ".experts." in n]) == 2 * 16 * 3 * 3
