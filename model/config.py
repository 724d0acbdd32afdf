"""Model configuration: one dataclass built from HF `config.json` (flat DeepSeek-V3 / K2-Thinking style, or
K2.5/K2.6 with the text model nested under `text_config`), plus presets.

Every value is checked for type and range when a config is built (a bool is not an integer, 2.5 is not a layer
count, a number must be finite); an error names the file and the key (`.../config.json: text_config.hidden_size
must be an integer, got "128"`). The JSON and file helpers here serve every config-like file.
"""

import copy
import json
import math
import os
import stat
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from ops.rope import yarn_mscale


class ConfigError(ValueError):
    """A config value of the wrong type or out of range: `where: key problem` (where: a file, or "config"), or
    with problem None a required key that is absent: `where: missing 'key'`."""

    def __init__(self, key, problem, where="config"):
        self.key, self.problem, self.where = key, problem, where
        super().__init__(f"{where}: missing {key!r}" if problem is None else f"{where}: {key} {problem}")

    def located(self, where, keys=None, prefix=""):
        """The same error naming the file it came from and the key's path there (`keys`: field -> path)."""
        head, dot, rest = self.key.partition(".")
        return ConfigError((keys or {}).get(head, prefix + head) + dot + rest, self.problem, where)


def describe(value):
    """A JSON value as an error message shows it: `"128"`, `2.5`, `null`, `true`, `a list`."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value[:60])
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return repr(value)


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    """A finite int or float (not a bool, NaN or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_KIND_NAMES = {int: "an integer", float: "a finite number", bool: "true or false", dict: "an object",
               tuple: "a list", type(None): "null"}


def _has_kind(value, kind):
    if kind is int:
        return is_int(value)
    if kind is float:
        return is_number(value)
    if kind is type(None):
        return value is None
    return isinstance(value, kind)


def check_types(obj):
    """ConfigError for the first field of dataclass `obj` whose value is not of the field's annotated type."""
    for f in fields(obj):
        value, kinds = getattr(obj, f.name), typing.get_args(f.type) or (f.type,)
        if not any(_has_kind(value, kind) for kind in kinds):
            want = " or ".join(_KIND_NAMES.get(kind, kind.__name__) for kind in kinds)
            raise ConfigError(f.name, f"must be {want}, got {describe(value)}")


def check_positive(obj, names, allow_zero=False):
    """ConfigError for the first of fields `names` of `obj` (numbers or None) that is not > 0 (>= 0)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (value >= 0 if allow_zero else value > 0):
            raise ConfigError(name, f"must be {'>= 0' if allow_zero else 'positive'}, got {value}")


def check_rope_scaling(scaling, key="rope_scaling"):
    """A rope_scaling object: null, type "default", or "yarn" with a positive factor and
    original_max_position_embeddings (other YaRN keys optional, positive when given)."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(key, f"must be an object or null, got {describe(scaling)}")
    kind = scaling.get("type", scaling.get("rope_type")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(key, f"has unsupported type {describe(kind)} (default or yarn)")
    if kind == "default":
        return
    for name in ("factor", "original_max_position_embeddings"):
        if scaling.get(name) is None:
            raise ConfigError(f"{key}.{name}", None)
    for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "attention_factor"):
        value = scaling.get(name)
        if value is not None and not (is_number(value) and value > 0):
            raise ConfigError(f"{key}.{name}", f"must be a positive number, got {describe(value)}")


def regular_file(path, what):
    """Raise unless `path` is a regular file (symlinks followed): FileNotFoundError naming it when missing,
    ValueError when it is a directory, a pipe or a device, or cannot be examined."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{what}: cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what}: {path} is {'a directory' if stat.S_ISDIR(mode) else 'not a regular file'}")


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def read_json(path, what):
    """The JSON object in file `path`; one error naming the file if it is missing, not a regular file, not
    UTF-8, not valid JSON (NaN and Infinity included) or not an object."""
    path = Path(path)
    regular_file(path, what)
    try:
        value = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ValueError(f"{what}: {path} is not UTF-8 text") from None
    except ValueError as err:
        raise ValueError(f"{what}: {path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{what}: {path} is not valid JSON: nested too deeply") from None
    except OSError as err:
        raise ValueError(f"{what}: cannot read {path}: {err.strerror or err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object, got {describe(value)}")
    return value


def config_file(path):
    """`path` itself, or `path`/config.json for a directory."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized INT4 for the routed experts (everything else stays bf16)."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True

    def __post_init__(self):
        check_types(self)

    @classmethod
    def from_hf(cls, qc, where="config", key="quantization_config"):
        def fail(sub, problem):
            raise ConfigError(f"{key}{sub}", problem, where)

        if not isinstance(qc, dict):
            fail("", f"must be an object, got {describe(qc)}")
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            fail(".quant_method", f"{describe(method)} is not supported (want 'compressed-tensors')")
        if qc.get("format") not in (None, "pack-quantized"):
            fail(".format", f"{describe(qc.get('format'))} is not supported (want 'pack-quantized')")
        groups = {} if qc.get("config_groups") is None else qc["config_groups"]
        if not isinstance(groups, dict):
            fail(".config_groups", f"must be an object, got {describe(groups)}")
        name, group = next(iter(groups.items()), ("group_0", {}))
        weights = group.get("weights") if isinstance(group, dict) else group
        weights = {} if weights is None else weights
        where_weights = f".config_groups.{name}.weights"
        if not isinstance(weights, dict):
            fail(where_weights, f"must be an object, got {describe(weights)}")
        try:
            cfg = cls(num_bits=weights.get("num_bits", 4), group_size=weights.get("group_size", 32),
                      symmetric=weights.get("symmetric", True))
        except ConfigError as err:
            raise err.located(where, prefix=f"{key}{where_weights}.") from None
        strategy = weights.get("strategy", "group")
        if (cfg.num_bits, cfg.group_size, cfg.symmetric) != (4, 32, True) or strategy != "group":
            fail(where_weights, f"only symmetric INT4 group-32 is supported, got {weights}")
        return cfg

    def to_hf(self):
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": self.num_bits, "type": "int", "symmetric": self.symmetric,
                        "strategy": "group", "group_size": self.group_size, "dynamic": False,
                    },
                }
            },
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
        }


@dataclass(frozen=True)
class ModelConfig:
    # sizes
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    intermediate_size: int = 18432
    # MoE
    first_k_dense_replace: int = 1
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    # MLA
    num_attention_heads: int = 64
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 50000.0
    rope_scaling: dict | None = field(default_factory=lambda: {
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    })
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-6  # q_a_layernorm and kv_a_layernorm (as HF transformers and DeepSeek's code)
    tie_word_embeddings: bool = False
    # tokens
    bos_token_id: int = 163584
    eos_token_id: int = 163585
    pad_token_id: int = 163839
    quantization: QuantConfig | None = field(default_factory=QuantConfig)

    def __post_init__(self):
        check_types(self)
        check_positive(self, ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                              "moe_intermediate_size", "n_group", "topk_group", "num_attention_heads", "q_lora_rank",
                              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                              "max_position_embeddings", "rms_norm_eps", "latent_norm_eps", "routed_scaling_factor"))
        check_positive(self, ("first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                              "bos_token_id", "eos_token_id", "pad_token_id"), allow_zero=True)
        if not self.rope_theta > 1:
            raise ConfigError("rope_theta", f"must be greater than 1, got {self.rope_theta}")
        check_rope_scaling(self.rope_scaling)
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.has_moe:
            if self.n_routed_experts % self.n_group or not self.topk_group <= self.n_group:
                raise ConfigError("n_group", f"{self.n_group} with n_routed_experts {self.n_routed_experts} and "
                                  f"topk_group {self.topk_group} does not fit")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError("num_experts_per_tok", f"{self.num_experts_per_tok} is out of range "
                                  f"1..{self.n_routed_experts}")
            if self.quantization and self.moe_intermediate_size % self.quantization.group_size:
                raise ConfigError("moe_intermediate_size", "must be a multiple of the quantisation group "
                                  f"{self.quantization.group_size}, got {self.moe_intermediate_size}")
        if self.quantization and self.hidden_size % self.quantization.group_size:
            raise ConfigError("hidden_size", "must be a multiple of the quantisation group "
                              f"{self.quantization.group_size}, got {self.hidden_size}")

    # derived
    @property
    def has_moe(self):
        return self.first_k_dense_replace < self.num_hidden_layers and self.n_routed_experts > 0

    def is_moe_layer(self, layer):
        return self.has_moe and layer >= self.first_k_dense_replace

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_entry_dim(self):
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self):
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling or {}
        if rs.get("mscale_all_dim"):
            scale *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
        return scale

    # HF config.json
    # sizes that shape the model and its cache: a config.json must give them (no K2.6 default is assumed)
    REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")

    @classmethod
    def from_hf(cls, hf, where="config"):
        """From an HF config dict (flat, or the text model under `text_config`); `where` names its file in errors."""
        if not isinstance(hf, dict):
            raise ValueError(f"{where}: must hold a JSON object, got {describe(hf)}")
        nested = "text_config" in hf
        text, prefix = (hf["text_config"], "text_config.") if nested else (hf, "")
        if not isinstance(text, dict):
            raise ConfigError("text_config", f"must be an object, got {describe(text)}", where)
        missing = [key for key in cls.REQUIRED if text.get(key) is None]
        if missing:
            raise ConfigError(prefix + missing[0], None, where)
        known = {f.name for f in fields(cls)} - {"quantization", "rope_scaling", "latent_norm_eps"}
        kwargs = {k: text[k] for k in known if k in text and text[k] is not None}
        if "q_lora_rank" in text and text["q_lora_rank"] is None:  # null means no q LoRA, not the default
            kwargs["q_lora_rank"] = None
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(kwargs.get(key), list):
                if not kwargs[key]:
                    raise ConfigError(prefix + key, "is an empty list", where)
                kwargs[key] = kwargs[key][0]
        scaling_key = "rope_scaling" if text.get("rope_scaling") is not None else "rope_parameters"
        scaling = text.get(scaling_key)
        keys = {"rope_scaling": prefix + scaling_key}
        try:
            check_rope_scaling(scaling)
        except ConfigError as err:
            raise err.located(where, keys, prefix) from None
        scaling = dict(scaling or {})
        if scaling.get("rope_theta") is not None and "rope_theta" not in text:
            kwargs["rope_theta"] = scaling["rope_theta"]
            keys["rope_theta"] = prefix + scaling_key + ".rope_theta"
        scaling.setdefault("type", scaling.get("rope_type") or "default")
        kwargs["rope_scaling"] = scaling if scaling["type"] != "default" else None
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if text.get(key, want) != want or isinstance(text.get(key), bool):
                raise ConfigError(prefix + key, f"{describe(text[key])} is not supported (want {describe(want)})",
                                  where)
        qc_key, qc = "quantization_config", hf.get("quantization_config")  # top level, or inside text_config
        if qc is None:
            qc_key, qc = prefix + qc_key, text.get(qc_key)
        kwargs["quantization"] = QuantConfig.from_hf(qc, where, qc_key) if qc is not None else None
        try:
            return cls(**kwargs)
        except ConfigError as err:
            raise err.located(where, keys, prefix) from None

    @classmethod
    def from_file(cls, path):
        file = config_file(path)
        return cls.from_hf(read_json(file, "config"), str(file))

    def to_hf(self):
        """The K2.5/K2.6-style config.json: the text model nested under `text_config`."""
        text = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
                if f.name not in ("quantization", "latent_norm_eps")}
        text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=
                    self.num_attention_heads, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                    hidden_act="silu", attention_bias=False)
        hf = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}
        if self.quantization:
            hf["quantization_config"] = self.quantization.to_hf()
        return hf


PRESETS = {
    "kimi-k2.6": ModelConfig(),
    # tiny shapes for tests and the embedded default; the latent cache entry keeps K2.6's 512 + 64
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=3, intermediate_size=256, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "tiny-grouped": ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=3, intermediate_size=256, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=64, num_attention_heads=4,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        max_position_embeddings=4096, rope_scaling=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
}


def preset(name):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
