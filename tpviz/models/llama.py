"""tpviz's own Llama-family decoder (RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP).

Parameter names and numerics follow transformers' `LlamaForCausalLM`, so the same checkpoint
loads in both and gives the same logits. Attention infers its local head count from the
projection outputs, so it runs unchanged when q/k/v are column-sharded over ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaDims


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(dims: LlamaDims, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse rotary frequencies, with the `linear` and `llama3` scalings real configs use
    (the rope types `LlamaDims.from_config` admits)."""
    d = dims.head_dim
    inv_freq = 1.0 / (
        dims.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d)
    )
    scaling = dims.rope_scaling
    kind = scaling["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    factor = float(scaling["factor"])  # llama3
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, dims: LlamaDims):
        super().__init__()
        self.dims = dims
        # on meta only the shape matters (and meta arange would import torch._dynamo)
        on_meta = torch.get_default_device().type == "meta"
        inv_freq = torch.empty(dims.head_dim // 2) if on_meta else rope_inv_freq(dims)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tpviz_compute_buffers(self, device: torch.device) -> None:
        """Recompute `inv_freq` for real after the module was built on meta."""
        self.inv_freq = rope_inv_freq(self.dims, device)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, dims: LlamaDims):
        super().__init__()
        h, kv, d, bias = dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.attention_bias
        self.head_dim = d
        self.q_proj = nn.Linear(dims.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(dims.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(dims.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, dims.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under colwise sharding each rank sees only its own heads
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dims: LlamaDims):
        super().__init__()
        hidden, inter, bias = dims.hidden_size, dims.intermediate_size, dims.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dims: LlamaDims):
        super().__init__()
        self.self_attn = Attention(dims)
        self.mlp = MLP(dims)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, dims: LlamaDims):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(dims)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, dims: LlamaDims, config: dict | None = None):
        super().__init__()
        self.dims = dims
        self.config = dict(config or {})
        self.model = LlamaModel(dims)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
        if dims.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


# transformers' plan for Llama: its `base_model_tp_plan`, the embedding it adds for every
# base model, and `LlamaForCausalLM._tp_plan`.
DEFAULT_PLAN: dict[str, str] = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
