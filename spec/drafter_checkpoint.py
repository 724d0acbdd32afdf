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

from model.parallel import Parallel
from spec.drafter import DFlashDrafter, DrafterConfig

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


def _shard_files(path):
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / f for f in weight_map.values()})
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"drafter checkpoint: no model.safetensors or index in {path}")
    return [single]


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


def _read_file(file, expected, par):
    out = {}
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            if name.endswith(_IGNORED):
                continue
            if name not in expected:
                raise ValueError(f"drafter checkpoint: unexpected tensor {name!r} in {file.name}")
            full = f.get_slice(name)
            if tuple(full.get_shape()) != tuple(expected[name]):
                raise ValueError(f"drafter checkpoint: {name} has shape {tuple(full.get_shape())}, config wants "
                                 f"{tuple(expected[name])}")
            out[name] = full[_rank_index(name, expected[name], par)]
    return out


def load_drafter(path, target=None, dtype=torch.bfloat16, device="cpu"):
    """Load a z-lab DFlash checkpoint directory; with `target`, check it fits and bind it.

    Every expected tensor must be present with the expected shape; unknown tensors are an error. Under the
    target's tensor parallelism only this rank's slices are read (heads and the MLP intermediate split).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter checkpoint: {path} is not a directory")
    cfg = DrafterConfig.from_file(path)
    par = target.par if target is not None else Parallel()
    drafter = DFlashDrafter(cfg, dtype=dtype, device=device, parallel=par)
    expected = {name: buf.shape for name, buf in checkpoint_tensors(DFlashDrafter(cfg, dtype, "meta")).items()}
    loaded = {}
    for file in _shard_files(path):
        try:
            loaded.update(_read_file(file, expected, par))
        except SafetensorError as err:
            raise ValueError(f"drafter checkpoint: cannot read {file}: {err}") from None
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"drafter checkpoint: missing {len(missing)} tensors, e.g. {missing[0]!r}")
    state = {}
    for name, tensor in loaded.items():
        if name.endswith("mlp.gate_proj.weight"):
            prefix = name[: -len("gate_proj.weight")]
            state[prefix + "gate_up.weight"] = torch.cat([tensor, loaded[prefix + "up_proj.weight"]])
        elif not name.endswith("mlp.up_proj.weight"):
            state[name] = tensor
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return drafter.bind(target) if target is not None else drafter
