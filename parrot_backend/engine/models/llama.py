"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a paged KV cache.

Module names match Hugging Face checkpoints, so a safetensors state dict loads as is.
The forward pass takes a flat batch of new tokens from many sequences (continuous
batching); attention goes through an `AttentionBackend`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from parrot_backend.contract.errors import UnsupportedModel

from ..attention import AttentionBackend, AttentionMetadata
from .linear import linear_function, prepare_weight, torch_linear


class Linear(nn.Linear):
    """`nn.Linear` whose matmul the model picks once (`use_linear`, `models/linear.py`)."""

    fn = staticmethod(torch_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, the same values (nothing to round back): a decode step runs
            # this 61 times on SmolLM2, and the four-op form cost ~1.5x as long
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for RoPE and the attention scaling factor.

    Supports the default schedule, linear scaling and Llama 3's frequency-dependent
    scaling; anything else is refused rather than silently computed wrong.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    head_dim = head_dim_of(config)
    partial = getattr(config, "partial_rotary_factor", 1.0)
    dim = int(head_dim * partial)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / params["factor"]
    elif kind == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    else:
        raise UnsupportedModel(f"RoPE scaling type {kind!r} is not supported")
    return inv.float(), 1.0


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        inv, self.scaling = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * self.scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * self.scaling, persistent=False)
        # sin with the rotate-half sign folded in (-sin on the first half): with it a
        # rotation is x * cos + roll(x, D / 2) * signed_sin, three ops (`apply_full`)
        half = inv.shape[0]
        signed = emb.sin() * self.scaling
        signed[:, :half] = -signed[:, :half]
        self.register_buffer("signed_sin", signed, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and signed sin rows for these positions, shaped to broadcast over heads
        (once a step)."""
        return (
            self.cos[positions].unsqueeze(1),
            self.sin[positions].unsqueeze(1),
            self.signed_sin[positions].unsqueeze(1),
        )

    @staticmethod
    def apply_full(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`apply` for float32 `x` [T, H, D] rotated over all of D (the same values; ~3x
        faster at decode sizes: 3 ops instead of 9)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; rotate-half convention (as in Hugging Face checkpoints)
        rot = x.shape[-1] if cos.shape[-1] >= x.shape[-1] else cos.shape[-1]
        xr, xp = x[..., :rot].float(), x[..., rot:]
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        out = (xr * cos + rotated * sin).to(x.dtype)
        return torch.cat([out, xp], dim=-1) if xp.numel() else out


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        h = config.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(
            self.num_heads * self.head_dim, h, bias=getattr(config, "o_proj_bias", False)
        )
        self.qk_norm = getattr(config, "model_type", "") == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def fuse(self) -> None:
        """Merge q/k/v projections into one matmul (after loading checkpoint weights)."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = None
        if self.q_proj.bias is not None:
            b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        self.qkv_proj = Linear(
            w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype
        )
        self.qkv_proj.weight = nn.Parameter(w, requires_grad=False)
        if b is not None:
            self.qkv_proj.bias = nn.Parameter(b, requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x):
        if hasattr(self, "qkv_proj"):
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return self.qkv_proj(x).split([nq, nk, nk], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, rope, kv_cache, meta, backend: AttentionBackend):
        t = x.shape[0]
        nq, nk, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin, signed_sin = rope
        if (
            hasattr(self, "qkv_proj")
            and not self.qk_norm
            and x.dtype == torch.float32
            and cos.shape[-1] == d
        ):
            # q and k are adjacent columns of the fused projection: rotate them together
            qkv = self.qkv_proj(x)
            qk = Rotary.apply_full(qkv[:, : (nq + nk) * d].view(t, nq + nk, d), cos, signed_sin)
            q, k = qk[:, :nq], qk[:, nq:]
            v = qkv[:, (nq + nk) * d :].view(t, nk, d)
        else:
            q, k, v = self._qkv(x)
            q = q.reshape(t, nq, d)
            k = k.reshape(t, nk, d)
            v = v.reshape(t, nk, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.copy_rows is not None:
            rows = meta.copy_rows
            k2, v2 = k.index_select(0, rows), v.index_select(0, rows)
            backend.store_kv(k2, v2, k_cache, v_cache, meta.copy_slots)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def fuse(self) -> None:
        """Merge gate and up projections into one matmul."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_up_proj = Linear(
            w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype
        )
        self.gate_up_proj.weight = nn.Parameter(w, requires_grad=False)
        if self.gate_proj.bias is not None:
            self.gate_up_proj.bias = nn.Parameter(
                torch.cat([self.gate_proj.bias, self.up_proj.bias]), requires_grad=False
            )
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config, max_positions)

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        x, rope = self.embed(input_ids, positions)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, cache, meta, backend)
        return self.norm(x)

    def embed(self, input_ids, positions):
        """The first layer's input and the rotary tables: a step run layer by layer
        (`runner.py`, a step paused for more urgent work) calls this, each layer, `norm`."""
        return self.embed_tokens(input_ids), self.rotary.tables(positions)


class LlamaForCausalLM(nn.Module):
    """The causal LM: `forward` returns final hidden states; `logits` projects chosen rows."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.tie = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.linear = "torch"
        self._linear_fn = torch_linear
        self._head: torch.Tensor | None = None  # the tied LM head in oneDNN's layout

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, backend)

    def fuse(self) -> None:
        """Fuse projections for speed; call once after loading weights."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.use_linear(self.linear)  # the fused projections are new modules

    def use_linear(self, kind: str) -> None:
        """Run every projection and the LM head on `kind`'s matmul (`torch` or `onednn`,
        as `models/linear.py: pick_linear` chose), their weights in its layout (oneDNN's
        packed one: a tied head gets a packed copy of the embeddings)."""
        fn = linear_function(kind)
        for module in self.modules():
            if isinstance(module, Linear):
                module.fn = fn
                weight = prepare_weight(kind, module.weight.data)
                if weight is not module.weight.data:
                    module.weight = nn.Parameter(weight, requires_grad=False)
        self._head = None
        if self.tie and kind == "onednn":
            self._head = prepare_weight(kind, self.model.embed_tokens.weight.data)
        self.linear, self._linear_fn = kind, fn

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head is not None:
            weight = self._head
        else:
            weight = self.model.embed_tokens.weight if self.tie else self.lm_head.weight
        return self._linear_fn(hidden, weight).float()
