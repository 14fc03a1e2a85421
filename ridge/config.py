"""The model's shape, as every loader reports it and the model consumes it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict: {"rope_type": "llama3"|"linear"|"yarn", "factor": ..., ...}
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3
    name: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; ridge runs {', '.join(SUPPORTED_ARCHS)}")
        assert self.num_heads % self.num_kv_heads == 0, "query heads must group evenly over KV heads"
        assert self.head_dim % 2 == 0, "rotary embedding needs an even head_dim"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)
