"""A training forward that keeps less for the backward pass: the same function, fewer saved tensors.

On the ``cpu`` profile the update's peak memory is the activations autograd keeps between a micro-batch's
forward and backward passes (~1.5 MB a token on SmolLM2-135M in float32; ``benchmarks/NOTES.md``).
:func:`install` removes one redundant tensor per layer from a loaded CPU model: ``silu(gate) * up``,
as two autograd ops, keeps ``gate``, ``silu(gate)`` and ``up``; one function that recomputes
``silu(gate)`` (elementwise) in its backward pass keeps ``gate`` and ``up``. It runs the kernels
autograd runs for the two ops, so values and gradients are the same bit for bit (``tests/test_lean.py``),
and a run trained with it is the run trained without it.

Attention keeps its inputs and nothing else (:class:`_Recomputed`): ``transformers`` repeats each key and
value head for the query heads that share it, and SDPA keeps those repeated copies, three times the keys
and values, for its backward pass. The backward pass now runs the same repeat and the same SDPA forward
again on the kept inputs and differentiates that: the same kernels on the same values, so the gradients
are the same bit for bit, for a second attention forward. (Tried before and left out: SDPA's ``enable_gqa``
with a mask keeps no copies either, but its gradients differ in float rounding, which flipped one sampled
token by step 7 of a 30-step run: the committed results would no longer regenerate bit for bit.)

In bf16 (``dtype: auto`` on a CPU with AVX512-BF16 or AMX) :func:`install` also runs the adapters in bf16
under autocast, their fp32 weights staying the master copies the optimizer updates. PEFT would otherwise
cast each LoRA layer's bf16 input to fp32 to meet the adapter's fp32 weight, and keep that copy for the
backward pass: seven copies per layer, more than half of what a bf16 update keeps (``benchmarks/NOTES.md``).
Under autocast the adapter reads the bf16 input the base layer already keeps. Not bit-identical to the fp32
adapter path: ``A`` and ``B`` are rounded to bf16 in the forward pass, as the rollouts' merged weights
(``agonlib.generation.fast``) already were.

In bf16 the RMSNorms keep their bf16 input instead of its float32 upcast (they normalise in float32), again
by running the norm again in the backward pass (:class:`_Recomputed`): half the bytes, the same gradients.

In bf16 the LM head also gets its input in one block. ``transformers`` hands it ``hidden[:, -k:]``
(``logits_to_keep``), a view ``torch.matmul`` cannot fold into one matrix product while it needs a gradient: it
multiplies row by row and first copies the head's weight once per row, ``(rows, hidden, vocab)`` (396 MB for 7
rows of SmolLM2 in bf16). In one block it is one product, 11× faster. In float32 it would be 2.5× faster, but
it rounds differently (the shared-prefix gradient test moved by ~1e-6), so the committed float32 runs would
no longer regenerate bit for bit: left as it is there.

And one for the allocator: :func:`release_free_memory` hands glibc's free heap pages back to the system.
A forward pass leaves its temporaries' pages free between the activations it keeps; glibc keeps them
resident, and the backward pass's peak stacks on top (``benchmarks/NOTES.md``). The update calls it
between a micro-batch's forward and backward passes, and :func:`install` after every
:data:`RELEASE_EVERY`-th decoder layer (and the last) of a forward pass that keeps activations: there, at
the end of the forward, glibc held ~660 MB of such pages, the step's peak. Not after every layer: pages
handed back are faulted in again by the next layer's temporaries, and trimming after each of SmolLM2's 30
layers made the update ~3% slower than every fourth (one run's means) for ~25 MiB less peak
(``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import types

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["LEAN_SDPA", "bf16_adapters", "install", "installed", "release_free_memory"]

LEAN_SDPA = "agon_lean_sdpa"  # transformers' SDPA attention, keeping only its inputs for the backward pass
RELEASE_EVERY = 4  # decoder layers between two hand-backs of free heap pages in a training forward


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` for the backward pass and nothing else."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # The kernels autograd runs for the two ops: the same gradients, bit for bit.
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class _Recomputed(torch.autograd.Function):
    """``fn(*tensors)``, keeping only ``tensors`` for the backward pass, which runs ``fn`` again and differentiates it.

    The second run is the first one's kernels on the same values (under the same autocast state), so the
    gradients are those autograd would have given from what ``fn`` saved, bit for bit (``tests/test_lean.py``).
    ``fn`` returns one tensor and draws no random numbers.
    """

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn, ctx.autocast = fn, (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = [t if t is None else t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled):
            out = ctx.fn(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, *(next(grads) if t is not None and t.requires_grad else None for t in inputs))


def _recomputed(fn, *tensors) -> torch.Tensor:
    """``fn(*tensors)``; while a gradient is wanted, through :class:`_Recomputed`."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _Recomputed.apply(fn, *tensors)
    return fn(*tensors)


def _lean_sdpa(module, query, key, value, attention_mask, **kwargs):
    """``transformers``' SDPA attention (the same call), keeping ``query``, ``key``, ``value`` and the mask only."""
    def attend(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0]

    return _recomputed(attend, query, key, value, attention_mask), None


AttentionInterface.register(LEAN_SDPA, _lean_sdpa)
AttentionMaskInterface.register(LEAN_SDPA, sdpa_mask)  # the masks SDPA gets


def _norm_forward(self, x):
    return _recomputed(functools.partial(type(self).forward, self), x)


def _release_after_layer(module, args, output) -> None:
    """A decoder layer's forward hook: its temporaries' pages back to the system while activations are kept."""
    if torch.is_grad_enabled():
        release_free_memory()


def _swiglu_forward(self, x):
    return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x)))


def _autocast_forward(self, *args, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return type(self).forward(self, *args, **kwargs)


def _inner(model):
    """The transformers model under a PEFT wrapper (or ``model`` itself)."""
    return getattr(model, "get_base_model", lambda: model)()


def _runs(module, forward) -> bool:
    """Whether ``module``'s own (instance) forward is ``forward``."""
    return getattr(vars(module).get("forward"), "__func__", None) is forward


def _lora_layers(inner) -> list:
    return [m for m in inner.modules() if hasattr(m, "cast_input_dtype_enabled") and hasattr(m, "lora_A")]


def bf16_adapters(model) -> bool:
    """Whether :func:`install` runs ``model``'s adapters in bf16 under autocast."""
    return _runs(_inner(model), _autocast_forward)


def _contiguous_input(module, args):
    x = args[0]
    # Not .contiguous(): a (1, 1, H) slice counts as contiguous with strides matmul will not fold. This copies
    # only where the rows are not one block already, and gives the strides matmul folds.
    return (x.reshape(-1, x.size(-1)).view(x.shape), *args[1:])


def installed(model) -> bool:
    """Whether :func:`install` switched ``model``'s MLPs over."""
    return any(_runs(m, _swiglu_forward) for m in model.modules())


def _norms(inner) -> list:
    """The RMSNorms of a ``transformers`` model whose weight is frozen (the adapters train, the norms do not)."""
    return [m for m in inner.modules() if type(m).__name__.endswith("RMSNorm")
            and not any(p.requires_grad for p in m.parameters())]


def install(model) -> bool:
    """Make a CPU model's training forward lean (the module docstring); returns whether its MLPs were switched.

    Its SwiGLU MLPs run :class:`_SwiGLU`, its SDPA attention :data:`LEAN_SDPA`, and every
    :data:`RELEASE_EVERY`-th decoder layer (and the last) releases free heap pages after its forward while a
    gradient is wanted; in bf16 its RMSNorms keep their bf16 input, its adapters run under autocast and its
    LM head gets its input in one block. Left alone:
    a model off the CPU (a GPU keeps its own kernels, Unsloth's among them) and MLPs that are not
    ``down(silu(gate(x)) * up(x))``.
    """
    inner = _inner(model)
    weight = next(inner.parameters())
    if weight.device.type != "cpu" or getattr(getattr(inner, "config", None), "hidden_act", None) != "silu":
        return False
    mlps = [m for m in inner.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))]
    for module in mlps:
        module.forward = types.MethodType(_swiglu_forward, module)
    if getattr(inner.config, "_attn_implementation", None) == "sdpa":
        inner.set_attn_implementation(LEAN_SDPA)
    layers = [m for m in inner.modules() if type(m).__name__.endswith("DecoderLayer")]
    for i, layer in enumerate(layers):
        releases = i % RELEASE_EVERY == RELEASE_EVERY - 1 or i == len(layers) - 1
        if releases and getattr(layer, "_agon_release", None) is None:  # once
            layer._agon_release = layer.register_forward_hook(_release_after_layer)  # the hook's handle
    if weight.dtype != torch.bfloat16:
        return bool(mlps)
    for module in _norms(inner):
        module.forward = types.MethodType(_norm_forward, module)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is not None and getattr(head, "_agon_contiguous_input", None) is None:  # once
        head._agon_contiguous_input = head.register_forward_pre_hook(_contiguous_input)  # the hook's handle
    loras = _lora_layers(inner)
    if loras:
        for module in loras:  # the bf16 input goes to the adapter as it is; autocast casts its weights
            module.cast_input_dtype_enabled = False
        # On the base model: PeftModel.forward and .generate both reach it; nothing reaches a LoRA layer otherwise.
        inner.forward = types.MethodType(_autocast_forward, inner)
    return bool(mlps)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to release this way
        return None


def release_free_memory(device: torch.device | str = "cpu") -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``); whether it could.

    A no-op off the CPU and where the C library is not glibc. Costs milliseconds.
    """
    trim = _malloc_trim() if torch.device(device).type == "cpu" else None
    if trim is None:
        return False
    trim(0)
    return True
