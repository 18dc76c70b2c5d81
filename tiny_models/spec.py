"""Model specs: one frozen dataclass per (arch, preset), and the HF config files derived from it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
PRESETS = ("tiny", "large", "a3b", "skewed", "deep")
NUM_WORKERS = 8  # pool B size: experts are split evenly across workers
FORMAT_VERSION = 1  # bump when the code changes the bytes written for an unchanged spec

_HF_NAMES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@dataclass(frozen=True, slots=True)
class InitScales:
    """Init scales. Linear weights get std = gain / sqrt(fan_in); `embed` and `bias` are absolute stds.

    With every norm weight at 1, a random model decodes decisively only if: the residual stream is
    O(1) per element and each sublayer adds a comparable amount (so attention and experts matter);
    router logits are spread out (std `router`), so that when bf16 noise swaps the k-th and
    (k+1)-th expert the swapped weight is small; lm_head logits have std `lm_head`. Top-1/top-2
    gaps of ~840 Gaussian logits average ~lm_head/3.7; at 4.5 the top logit usually sits just
    below 16, where vLLM's bf16 logits have ulp 0.0625, which makes exact bf16 ties rarer than at
    larger or smaller scales. Ties at the bf16 ulp remain (a few % of steps): compare greedy
    tokens only up to the first step whose reference margin is within a few ulp.
    """

    embed: float = 1.0
    attn: float = 1.0  # q, k, v, o
    expert: float = 1.0  # gate and up projections, routed and shared experts
    expert_down: float = 1.5
    router: float = 4.0
    lm_head: float = 4.5
    bias: float = 0.1  # q/k/v biases (qwen2_moe)


@dataclass(frozen=True, slots=True)
class RouterSkew:
    """Routers that strongly prefer a few experts, the way real ones do when a hidden dimension
    carries a large activation shared by every token: each token embedding gets `embed_offset` on
    dimension 0, and every MoE layer's router row of each hot expert weights that dimension by
    `router_gain` more (as a std / sqrt(fan_in) multiple, like the init scales)."""

    hot_experts: tuple[int, ...]
    embed_offset: float
    router_gain: float


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything that determines a checkpoint's bytes, besides the seed and the tokenizer corpus."""

    arch: str
    preset: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_expert_intermediate: int = 0  # qwen2_moe only
    vocab_size: int = 1024  # tokenizer size rounded up to a multiple of 64
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    init: InitScales = InitScales()
    skew: RouterSkew | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {ARCHS}")
        if self.num_experts % NUM_WORKERS:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by {NUM_WORKERS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} out of range for {self.num_experts} experts")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size % 64:
            raise ValueError("vocab_size must be a multiple of 64")
        if (self.arch == "qwen2_moe") != (self.shared_expert_intermediate > 0):
            raise ValueError("a shared expert is required for qwen2_moe and unsupported otherwise")
        if self.arch == "qwen2_moe" and self.head_dim * self.num_heads != self.hidden_size:
            # vLLM's Qwen2-MoE ignores config.head_dim and uses hidden_size // num_heads.
            raise ValueError("qwen2_moe needs head_dim * num_heads == hidden_size")
        if self.skew is not None and not all(0 <= e < self.num_experts for e in self.skew.hot_experts):
            raise ValueError(f"hot experts {self.skew.hot_experts} out of range for {self.num_experts} experts")

    @property
    def hf_architecture(self) -> str:
        return _HF_NAMES[self.arch]

    def fingerprint(self, seed: int, corpus_sha256: str) -> str:
        """sha256 over everything the checkpoint's bytes depend on."""
        spec = dataclasses.asdict(self)
        if self.skew is None:
            del spec["skew"]  # so that the checkpoints made before skew existed keep their fingerprint
        inputs = {"format": FORMAT_VERSION, "spec": spec, "seed": seed}
        blob = json.dumps(inputs | {"corpus": corpus_sha256}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _tiny(arch: str) -> ModelSpec:
    common = dict(arch=arch, preset="tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    if arch == "qwen3_moe":
        return ModelSpec(**common, head_dim=64, num_experts=16, top_k=4, expert_intermediate=64)
    if arch == "qwen2_moe":
        return ModelSpec(
            **common, head_dim=32, num_experts=16, top_k=4, expert_intermediate=64,
            shared_expert_intermediate=128,
        )
    return ModelSpec(**common, head_dim=64, num_experts=8, top_k=2, expert_intermediate=128)


def _large(arch: str) -> ModelSpec:
    common = dict(
        arch=arch, preset="large", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64
    )
    if arch == "qwen3_moe":
        return ModelSpec(**common, num_experts=64, top_k=8, expert_intermediate=768)
    if arch == "qwen2_moe":
        return ModelSpec(
            **common, num_experts=64, top_k=4, expert_intermediate=768, shared_expert_intermediate=1536,
        )
    return ModelSpec(**common, num_experts=32, top_k=2, expert_intermediate=1536)


def _a3b(arch: str) -> ModelSpec:
    """Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of width 768, top-8, GQA 32/4),
    4 layers instead of 48: the experts the GPU transport bench drives, 4.8 GB in bf16."""
    if arch != "qwen3_moe":
        raise ValueError("the a3b preset has Qwen3-MoE's shapes: arch must be qwen3_moe")
    return ModelSpec(arch=arch, preset="a3b", hidden_size=2048, num_layers=4, num_heads=32, num_kv_heads=4,
                     head_dim=128, num_experts=128, top_k=8, expert_intermediate=768)  # fmt: skip


def _skewed(arch: str) -> ModelSpec:
    """The tiny Qwen3-MoE whose routers send most tokens to experts 2, 9 and 13 (on three
    different workers): the expert-load tests' and heat map's model."""
    if arch != "qwen3_moe":
        raise ValueError("the skewed preset is a tiny Qwen3-MoE: arch must be qwen3_moe")
    return dataclasses.replace(_tiny(arch), preset="skewed",
                               skew=RouterSkew(hot_experts=(2, 9, 13), embed_offset=8.0, router_gain=40.0))  # fmt: skip


def _deep(arch: str) -> ModelSpec:
    """The tiny model with 16 layers instead of 4, for `make bench-pingpong ARGS="--preset deep"`: what a step costs
    once (sampling, ping-pong's fill and drain) spreads over more layers, as in real MoE models
    (Mixtral 32, Qwen3-30B-A3B 48); and positions up to 16384 (the bench's --context), where a layer's attention
    outweighs what each micro-batch costs the attention node by itself, as on a GPU."""
    return dataclasses.replace(_tiny(arch), preset="deep", num_layers=16, max_position_embeddings=16384)


def spec_for(arch: str, preset: str = "tiny") -> ModelSpec:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    return {"tiny": _tiny, "large": _large, "a3b": _a3b, "skewed": _skewed, "deep": _deep}[preset](arch)


def hf_config(spec: ModelSpec, special_ids: dict[str, int]) -> dict:
    """config.json contents, with the keys real hub checkpoints of this architecture carry.

    special_ids: {"bos": id, "eos": id, "pad": id} from the tokenizer.
    """
    config = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "use_cache": True,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "num_experts_per_tok": spec.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
        "pad_token_id": special_ids["pad"],
        "torch_dtype": "bfloat16",
    }
    if spec.arch == "mixtral":
        config |= {
            "head_dim": spec.head_dim,
            "intermediate_size": spec.expert_intermediate,
            "num_local_experts": spec.num_experts,
            "sliding_window": None,
        }
        return config
    config |= {
        "intermediate_size": spec.expert_intermediate * spec.top_k,  # dense MLP size; no dense layers here
        "moe_intermediate_size": spec.expert_intermediate,
        "num_experts": spec.num_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": spec.num_layers,
    }
    if spec.arch == "qwen3_moe":
        config |= {"head_dim": spec.head_dim, "attention_bias": False, "norm_topk_prob": True}
    else:
        config |= {
            "shared_expert_intermediate_size": spec.shared_expert_intermediate,
            "norm_topk_prob": False,
            "qkv_bias": True,
        }
    return config


def generation_config(special_ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": special_ids["bos"],
        "eos_token_id": [special_ids["eos"], special_ids["endoftext"]],
        "pad_token_id": special_ids["pad"],
        "do_sample": False,
    }
