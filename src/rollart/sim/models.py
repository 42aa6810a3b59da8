"""SIMULATED model profiles: the sizes a cost model needs, for Qwen3 dense and MoE models.

Sources: the Qwen3 technical report (arXiv 2505.09388, Tables 1-2) and each model's Hugging Face
``config.json`` (num_hidden_layers, hidden_size, num_key_value_heads, head_dim, num_experts,
num_experts_per_tok, moe_intermediate_size). Parameter counts are the report's totals
(embeddings included).

Attention FLOPs: a query token attending ``n`` keys costs 4 x layers x q_dim x n FLOPs (QK^T and
the weighted sum over V, 2 FLOPs per multiply-accumulate each; q_dim = num_attention_heads x
head_dim), as in the FLOP accounting of Kaplan et al. 2020 (Table 1, "2 n_layer n_ctx d_attn"
per forward token, doubled here for QK^T + AV counted separately) and Chinchilla (Hoffmann et
al. 2022, App. F). Query heads per model are ``num_attention_heads`` in each ``config.json``.

KV cache bytes per token = 2 (K and V) x layers x kv_heads x head_dim x kv_bytes_per_elem.
For MoE, the bytes one decode step reads depend on how many distinct experts the batch routes
to: with ``E`` experts, ``k`` chosen per token and uniform routing, a batch of ``B`` tokens
touches an expected fraction ``1 - (1 - k/E)^B`` of each layer's experts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    """Sizes of one model (SIMULATED use only).

    Attributes:
        name: e.g. ``"qwen3-8b"``.
        total_params: every parameter, embeddings included.
        active_params: parameters used per token (== total for dense models).
        num_layers, hidden_size, num_kv_heads, head_dim: attention shape (KV cache size).
        num_attention_heads: query heads (attention FLOPs); 0 = hidden_size // head_dim.
        bytes_per_param: weight dtype size (2 for bf16).
        kv_bytes_per_elem: KV cache dtype size (2 for bf16).
        num_experts, experts_per_token: MoE routing (0 for dense).
        expert_params: parameters in all experts of all layers (0 for dense).
    """

    name: str
    total_params: float
    active_params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    kv_bytes_per_elem: int = 2
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0
    num_attention_heads: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.active_params <= self.total_params:
            raise ValueError(f"ModelProfile {self.name!r}: need 0 < active_params <= "
                             f"total_params, got {self.active_params} / {self.total_params}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"ModelProfile {self.name!r}: experts_per_token must be in "
                             f"(0, num_experts], got {self.experts_per_token}")
        if self.expert_params > self.total_params:
            raise ValueError(f"ModelProfile {self.name!r}: expert_params > total_params")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        """Query projection width: num_attention_heads x head_dim."""
        heads = self.num_attention_heads or self.hidden_size // self.head_dim
        return heads * self.head_dim

    def attention_flops(self, num_tokens: float, context_before: float) -> float:
        """Attention FLOPs of ``num_tokens`` causal query tokens after ``context_before`` cached
        tokens: 4 x layers x q_dim x keys, keys = n x context_before + n (n + 1) / 2."""
        if num_tokens < 0 or context_before < 0:
            raise ValueError(f"num_tokens and context_before must be >= 0, got {num_tokens}, "
                             f"{context_before}")
        keys = num_tokens * context_before + num_tokens * (num_tokens + 1) / 2.0
        return 4.0 * self.num_layers * self.q_dim * keys

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights (what a weight sync moves)."""
        return self.total_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token: 2 x layers x kv_heads x head_dim x kv dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    def weight_bytes_read(self, batch_tokens: int) -> float:
        """Weight bytes one forward pass over ``batch_tokens`` tokens reads from memory.

        Dense: all weights. MoE: the non-expert weights plus the expected share of experts the
        batch routes to (``1 - (1 - k/E)^B``, uniform routing).
        """
        if batch_tokens <= 0:
            return 0.0
        if not self.is_moe:
            return self.weight_bytes
        frac = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** batch_tokens
        dense = self.total_params - self.expert_params
        return (dense + frac * self.expert_params) * self.bytes_per_param


QWEN3_8B = ModelProfile("qwen3-8b", 8.2e9, 8.2e9, num_layers=36, hidden_size=4096,
                        num_kv_heads=8, head_dim=128, num_attention_heads=32)
QWEN3_14B = ModelProfile("qwen3-14b", 14.8e9, 14.8e9, num_layers=40, hidden_size=5120,
                         num_kv_heads=8, head_dim=128, num_attention_heads=40)
# 32B: 64 query heads x 128 = 8192 > hidden_size 5120 (config.json).
QWEN3_32B = ModelProfile("qwen3-32b", 32.8e9, 32.8e9, num_layers=64, hidden_size=5120,
                         num_kv_heads=8, head_dim=128, num_attention_heads=64)
# 48 layers x 128 experts x 3 matrices x 2048 x 768 (moe_intermediate_size) = 28.99e9 expert
# params; active = 30.5e9 - 28.99e9 + 28.99e9 * 8/128 = 3.32e9 (report: 3.3B activated).
QWEN3_30B_A3B = ModelProfile("qwen3-30b-a3b", 30.5e9, 3.3e9, num_layers=48, hidden_size=2048,
                             num_kv_heads=4, head_dim=128, num_experts=128,
                             experts_per_token=8, expert_params=48 * 128 * 3 * 2048 * 768,
                             num_attention_heads=32)

MODELS: dict[str, ModelProfile] = {
    p.name: p for p in (QWEN3_8B, QWEN3_14B, QWEN3_32B, QWEN3_30B_A3B)
}


def get_model(name: str) -> ModelProfile:
    """The profile called ``name`` (case-insensitive). Raises ``KeyError`` naming the choices."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
