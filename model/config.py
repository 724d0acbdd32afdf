"""Model configuration: one dataclass built from HF `config.json` (flat DeepSeek-V3 / K2-Thinking style, or
K2.5/K2.6 with the text model nested under `text_config`), plus presets."""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from ops.rope import yarn_mscale


def read_config_json(path, what):
    """The JSON object of `path` (or `path`/config.json); one clear error if it is missing or malformed."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{what}: {path} is not valid JSON: {err}") from None


@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized INT4 for the routed experts (everything else stays bf16)."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True

    @classmethod
    def from_hf(cls, qc):
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(f"quantization_config: unsupported quant_method {method!r} (want 'compressed-tensors')")
        if qc.get("format") not in (None, "pack-quantized"):
            raise ValueError(f"quantization_config: unsupported format {qc.get('format')!r} (want 'pack-quantized')")
        weights = next(iter(qc.get("config_groups", {}).values()), {}).get("weights", {})
        cfg = cls(
            num_bits=weights.get("num_bits", 4),
            group_size=weights.get("group_size", 32),
            symmetric=weights.get("symmetric", True),
        )
        if (cfg.num_bits, cfg.group_size, cfg.symmetric) != (4, 32, True) or weights.get("strategy", "group") != "group":
            raise ValueError(f"quantization_config: only symmetric INT4 group-32 is supported, got {weights}")
        return cls(cfg.num_bits, cfg.group_size, cfg.symmetric)

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
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.has_moe:
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"config: n_routed_experts {self.n_routed_experts} / n_group {self.n_group} / "
                                 f"topk_group {self.topk_group} do not fit")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"config: num_experts_per_tok {self.num_experts_per_tok} out of range")
            if self.quantization and self.moe_intermediate_size % self.quantization.group_size:
                raise ValueError("config: moe_intermediate_size must be a multiple of the quantisation group")
        if self.quantization and self.hidden_size % self.quantization.group_size:
            raise ValueError("config: hidden_size must be a multiple of the quantisation group")

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
    @classmethod
    def from_hf(cls, hf):
        outer = hf
        text = hf.get("text_config", hf)
        known = {f.name for f in fields(cls)} - {"quantization", "rope_scaling", "latent_norm_eps"}
        kwargs = {k: text[k] for k in known if k in text and text[k] is not None}
        if "q_lora_rank" in text and text["q_lora_rank"] is None:  # null means no q LoRA, not the default
            kwargs["q_lora_rank"] = None
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = kwargs[key][0]
        scaling = text.get("rope_scaling") or text.get("rope_parameters")
        if scaling and scaling.get("rope_theta") is not None and "rope_theta" not in text:
            kwargs["rope_theta"] = scaling["rope_theta"]
        kwargs["rope_scaling"] = dict(scaling) if scaling else None
        if kwargs["rope_scaling"] and "type" not in kwargs["rope_scaling"]:
            kwargs["rope_scaling"]["type"] = kwargs["rope_scaling"].get("rope_type", "default")
        for key in ("scoring_func", "topk_method"):
            want = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}[key]
            if text.get(key, want) != want:
                raise ValueError(f"config: unsupported {key} {text[key]!r} (want {want!r})")
        if text.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"config: unsupported moe_layer_freq {text['moe_layer_freq']}")
        qc = outer.get("quantization_config") or text.get("quantization_config")
        kwargs["quantization"] = QuantConfig.from_hf(qc) if qc else None
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path):
        return cls.from_hf(read_config_json(path, "config"))

    def to_hf(self):
        """The K2.5/K2.6-style config.json: the text model nested under `text_config`."""
        text = {f.name: getattr(self, f.name) for f in fields(self)
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
