"""Fast decoding for rollouts: one adapter merged into fused weights, a preallocated KV cache.

Why: on a 2-core CPU a decode step of SmolLM2-135M through PEFT and
``transformers`` runs three matmuls per LoRA linear (base, ``A``, ``B``), casts
and scales between them, grows the KV cache by concatenation every step and
rebuilds a 4-D mask per layer. Here each linear is one matmul with
``W + scaling · B @ A`` merged once per :func:`agonlib.generation.generate` call;
``q/k/v`` and ``gate/up`` are fused into one matmul each; keys and values go
into a cache allocated once; finished rows leave the batch in a single copy
when enough of them have finished. Measurements: ``benchmarks/NOTES.md``.

What stays the same: the model function (the norms, rotary embedding and
activation are the base model's own modules; the merged weight differs from
``W x + s·B(A x)`` only by float rounding — a test checks the log-probs against
the ``transformers`` forward) and the sampling (``agonlib.generation.sampling.draw``).
:class:`agonlib.generation.engines.FastEngine` runs it in agonlib's decode loop.

Supported: the Llama family (SmolLM2) and Qwen3 (``q_norm``/``k_norm``), dense,
no sliding window. :func:`supports` says whether a model qualifies; with
``decode_forward: auto`` the rollouts fall back to the ``transformers`` forward otherwise.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SUPPORTED = ("llama", "qwen3")


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports(model) -> bool:
    """True for the dense Llama/Qwen3 decoders this module knows how to run."""
    cfg = getattr(_base_model(model), "config", None)
    if getattr(cfg, "model_type", None) not in SUPPORTED:
        return False
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    return getattr(cfg, "hidden_act", "silu") == "silu"


def _merge_into(out: torch.Tensor, linear, adapter: str | None) -> torch.Tensor | None:
    """Write the effective weight of a possibly LoRA-wrapped linear under ``adapter`` into ``out``; return its bias.

    ``W + scaling · B @ A`` in one ``addmm``: the same merge as PEFT's
    ``get_delta_weight`` without its temporaries.
    """
    base = getattr(linear, "base_layer", linear)
    if adapter is not None and adapter in getattr(linear, "lora_A", {}):
        a, b = linear.lora_A[adapter].weight, linear.lora_B[adapter].weight  # (r, in), (out, r)
        torch.addmm(base.weight.detach(), b.detach().to(out.dtype), a.detach().to(out.dtype),
                    alpha=linear.scaling[adapter], out=out)
    else:
        out.copy_(base.weight.detach())
    return None if base.bias is None else base.bias.detach()


def _fused(linears, adapter) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The effective weights of ``linears`` (same input) stacked into one ``(sum out, in)`` weight, and bias."""
    weights = [getattr(lin, "base_layer", lin).weight for lin in linears]
    fused = torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype=weights[0].dtype,
                        device=weights[0].device)
    biases = [_merge_into(part, lin, adapter) for part, lin in zip(fused.split([w.shape[0] for w in weights]), linears)]
    if all(b is None for b in biases):
        return fused, None
    return fused, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


class Linear:
    """``y = x W^T + b``, with ``W`` prepacked for oneDNN when ``pack`` (CPU, float32 or bfloat16; :func:`_can_pack`).

    At decode shapes a prepacked weight runs 1.3–3× faster than ``F.linear`` in float32 on a 2-core
    AMD EPYC, and 1.6–2.5× faster in bfloat16 on a 2-core Xeon with AMX (``benchmarks/NOTES.md``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.bias = bias
        self.weight = None if pack else weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], -1)


def _can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's private prepacked linear is here and agrees with ``F.linear`` on ``weight``.

    float32 always (where oneDNN is); bfloat16 where the CPU has native bf16 (AVX512-BF16, AMX).
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    tol = 1e-4 if weight.dtype == torch.float32 else 2**-6  # bf16: a few ulps, both round fp32 sums to bf16
    try:
        if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).view(3, -1)
        got = Linear(weight, None, pack=True)(probe)
    except (AttributeError, RuntimeError):  # the private ops moved or refuse this build
        return False
    want = F.linear(probe, weight)
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


class _Layer:
    def __init__(self, layer, adapter, pack):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qkv = Linear(*_fused([attn.q_proj, attn.k_proj, attn.v_proj], adapter), pack)
        self.o = Linear(*_fused([attn.o_proj], adapter), pack)
        self.gate_up = Linear(*_fused([mlp.gate_proj, mlp.up_proj], adapter), pack)
        self.down = Linear(*_fused([mlp.down_proj], adapter), pack)


class KVCache:
    """Keys and values of every layer in one preallocated tensor each: ``(L, B, H_kv, T_max, d)``."""

    def __init__(self, layers: int, batch: int, heads: int, length: int, head_dim: int, dtype, device):
        self.k = torch.zeros(layers, batch, heads, length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.used = 0  # positions filled so far (the same for every row: prompts are left-padded)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (batch indices, in the new order).

        Rows that leave (``rows`` strictly increasing) are closed up in place, a copy of each row that moves;
        anything else (the prefill's repeated prompts) is copied row by row into new tensors. Both copy
        whole rows, the same values as ``k[:, rows]``, whose advanced indexing ran ~6× slower here
        (``benchmarks/NOTES.md``).
        """
        order = rows.tolist()
        if all(a < b for a, b in itertools.pairwise(order)):
            for j, r in enumerate(order):  # r >= j: a row's source is never a destination already written
                if r != j:
                    self.k[:, j].copy_(self.k[:, r])
                    self.v[:, j].copy_(self.v[:, r])
            self.k, self.v = self.k[:, :len(order)], self.v[:, :len(order)]
            return
        self.k, self.v = _gather_rows(self.k, order), _gather_rows(self.v, order)


def _gather_rows(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``t[:, order]`` by whole-row copies."""
    out = t.new_empty((t.shape[0], len(order), *t.shape[2:]))
    for j, r in enumerate(order):
        out[:, j].copy_(t[:, r])
    return out


class FastDecoder:
    """The base model under one adapter (``None`` = the base), ready to prefill and decode.

    Build it after the adapter's last update: the weights are merged at construction.
    """

    def __init__(self, model, adapter: str | None):
        base = _base_model(model)
        if not supports(base):
            raise ValueError(f"FastDecoder supports {', '.join(SUPPORTED)} models, not {base.config.model_type!r}.")
        cfg, inner = base.config, base.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        head_weight, head_bias = _fused([base.lm_head], adapter)
        self.dtype, self.device = head_weight.dtype, head_weight.device
        pack = _can_pack(head_weight)
        self.act = inner.layers[0].mlp.act_fn
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim**-0.5
        with torch.no_grad():
            self.lm_head = Linear(head_weight, head_bias, pack)
            self.layers = [_Layer(layer, adapter, pack) for layer in inner.layers]

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(len(self.layers), batch, self.kv_heads, length, self.head_dim, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the last position for ``ids`` ``(b, T)`` appended to ``cache``; returns ``(b, V)``.

        ``key_mask`` ``(b, used + T)`` marks real (non-padding) positions of the
        whole sequence so far; ``positions`` ``(b, T)`` are rotary positions.
        """
        b, T = ids.shape
        start, end = cache.used, cache.used + T
        h = self.embed(ids)  # (b, T, H)
        cos, sin = self.rotary(h, positions)
        # (b, 1, T, end): a query sees real keys up to itself; a padding query sees
        # itself too, so no softmax row is empty (its output is never used).
        mask = key_mask[:, None, None, :end].bool()
        if T > 1:
            query_pos = torch.arange(start, end, device=ids.device)[:, None]
            key_pos = torch.arange(end, device=ids.device)[None, :]
            mask = (mask & (key_pos <= query_pos)) | (key_pos == query_pos)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            x = layer.ln1(h)
            q, k, v = layer.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(b, T, self.heads, self.head_dim)
            k = k.view(b, T, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (b, h, T, d)
            cache.k[i, :, :, start:end] = k
            cache.v[i, :, :, start:end] = v.view(b, T, self.kv_heads, self.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, cache.k[i, :, :, :end], cache.v[i, :, :, :end], attn_mask=mask,
                                                 scale=self.scaling, enable_gqa=self.kv_heads != self.heads)
            h = h + layer.o(out.transpose(1, 2).reshape(b, T, q_size))
            gate, up = layer.gate_up(layer.ln2(h)).chunk(2, dim=-1)
            h = h + layer.down(self.act(gate) * up)
        cache.used = end
        return self.lm_head(self.norm(h[:, -1]))  # (b, V)
