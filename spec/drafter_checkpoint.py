"""DFlash drafter checkpoints in z-lab's format: `config.json` (Qwen3 keys, block_size, dflash_config) and
`model.safetensors` (or shards with `model.safetensors.index.json`) holding `fc.weight`, `hidden_norm.weight`,
`norm.weight` and `layers.i.{input_layernorm, post_attention_layernorm}.weight`,
`layers.i.self_attn.{q,k,v,o}_proj.weight`, `layers.i.self_attn.{q,k}_norm.weight`,
`layers.i.mlp.{gate,up,down}_proj.weight`. No embedding or lm_head: the drafter uses the target's."""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.checkpoint import LAYER, check_finite, checkpoint_files, model_bytes, read_headers
from model.config import config_file
from model.memory import check_fits
from model.parallel import Parallel
from spec.drafter import DFlashDrafter, DrafterConfig, check_drafter_fits

_IGNORED = ("rotary_emb.inv_freq",)


def checkpoint_tensors(drafter):
    """The drafter's weights under checkpoint names (gate_up split back into gate_proj and up_proj)."""
    out = {}
    for name, buf in drafter.state_dict().items():
        if name.endswith("mlp.gate_up.weight"):
            gate, up = buf.chunk(2, dim=0)
            prefix = name[: -len("gate_up.weight")]
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
        else:
            out[name] = buf
    return out


def write_drafter_checkpoint(path, cfg, tensors, dtype=torch.bfloat16, block_size_in_dflash_config=False):
    """Write config.json and model.safetensors for `cfg` and checkpoint-named `tensors` into directory `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf(block_size_in_dflash_config), indent=2))
    save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def drafter_entries(cfg):
    """{checkpoint name: full (unsharded) shape} of every tensor a drafter checkpoint for `cfg` holds."""
    D, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {"fc.weight": (D, len(cfg.target_layer_ids) * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, D), p + "mlp.up_proj.weight": (inter, D),
            p + "mlp.down_proj.weight": (D, inter),
        })
    return out


_ROW_SPLIT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight")
_COLUMN_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _rank_index(name, shape, par):
    """The slice of a full checkpoint tensor this tensor-parallel rank holds (heads and intermediate split)."""
    if name.endswith(_ROW_SPLIT):
        start, length = par.shard(shape[0], name)
        return (slice(start, start + length),)
    if name.endswith(_COLUMN_SPLIT):
        start, length = par.shard(shape[1], name)
        return (slice(None), slice(start, start + length))
    return (slice(None),)


FLOAT = ("BF16", "F16", "F32")
WHAT = "drafter checkpoint"


def load_drafter(path, target=None, dtype=torch.bfloat16, device="cpu"):
    """Load a z-lab DFlash checkpoint directory; with `target`, check it fits and bind it.

    Every expected tensor must be listed, with the expected shape and a float dtype (checked on the headers,
    and the config's layer count against the tensor names, before anything is allocated), and hold no NaN or
    inf; unknown tensors are an error, and an index may name only files inside the folder. Under the target's
    tensor parallelism only this rank's slices are read (heads and the MLP intermediate split).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{WHAT}: {path} is not a directory")
    cfg = DrafterConfig.from_file(path)
    if target is not None:
        check_drafter_fits(cfg, target.cfg)
        if cfg.block_size > target.cfg.max_position_embeddings:
            raise ValueError(f"{WHAT}: block_size {cfg.block_size} does not fit the target's context of "
                             f"{target.cfg.max_position_embeddings}")
    files = {name: file for name, file in checkpoint_files(path, WHAT).items() if not name.endswith(_IGNORED)}
    layers = {int(m[1]) for name in files if (m := LAYER.match(name))}
    held = max(layers) + 1 if layers else 0
    if cfg.num_hidden_layers > held:
        raise ValueError(f"{WHAT}: {config_file(path)} says num_hidden_layers {cfg.num_hidden_layers}, but the "
                         f"shards hold {held} layers")
    par = target.par if target is not None else Parallel()
    expected = drafter_entries(cfg)
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise ValueError(f"{WHAT}: unexpected tensor {unexpected[0]!r} in {files[unexpected[0]].name}")
    missing = sorted(set(expected) - set(files))
    if missing:
        raise ValueError(f"{WHAT}: missing {len(missing)} tensors in {path}, e.g. {missing[0]!r}")
    for name, (shape, dtype_name) in read_headers(files, WHAT).items():
        if shape != expected[name]:
            raise ValueError(f"{WHAT}: {name} in {files[name].name} has shape {shape}, config wants {expected[name]}")
        if dtype_name not in FLOAT:
            raise ValueError(f"{WHAT}: {name} in {files[name].name} has dtype {dtype_name}, expected "
                             f"{' or '.join(FLOAT)}")
    drafter = DFlashDrafter(cfg, dtype=dtype, device="meta", parallel=par)
    check_fits("the drafter's weights", model_bytes(drafter), device)
    drafter = DFlashDrafter(cfg, dtype=dtype, device=device, parallel=par)
    loaded = {}
    for file in sorted(set(files.values())):
        names = [name for name in files if files[name] == file]
        loaded.update(_read_file(file, names, expected, par))
    state = {}
    for name, tensor in loaded.items():
        if name.endswith("mlp.gate_proj.weight"):
            prefix = name[: -len("gate_proj.weight")]
            state[prefix + "gate_up.weight"] = torch.cat([tensor, loaded[prefix + "up_proj.weight"]])
        elif not name.endswith("mlp.up_proj.weight"):
            state[name] = tensor
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return drafter.bind(target) if target is not None else drafter


def _read_file(file, names, expected, par):
    """This rank's slices of `names` from one shard, checked for NaN and inf."""
    out = {}
    with safe_open(str(file), framework="pt") as f:
        for name in names:
            try:
                out[name] = f.get_slice(name)[_rank_index(name, expected[name], par)]
            except SafetensorError as err:
                raise ValueError(f"{WHAT}: cannot read {name} from {file}: {err}") from None
    check_finite(list(out.items()), file, WHAT)
    return out
