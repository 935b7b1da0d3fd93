"""A CPU stand-in for the part of ``vllm.LLM`` that :class:`agonlib.generation.backends.VLLMBackend` calls.

:class:`ReferenceEngine` reads each adapter back from the directory its
``LoRARequest`` names into a private copy of the model and samples with
agonlib's decode loop (same engines, sampler, prompt layout and per-completion
seeds), so on the same weights it returns exactly the transformers path's tokens, with raw log-probs
of the sampled tokens. The tests and ``scripts/gpu_check.py --dry-run``
drive the vLLM backend's whole bookkeeping with it — directories, request
ids, seeds, parsing, the mismatch log — without vLLM. It proves nothing about
vLLM itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from ..grpo import completion_logprobs
from ..models import load_policies
from .engines import engine_for
from .layout import distinct
from .loop import decode_batch
from .sampling import SamplingParams
from .stops import complete


@dataclass(frozen=True)
class RefSamplingParams:
    """The fields of ``vllm.SamplingParams`` that :class:`VLLMBackend` sets."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple = ()
    logprobs: int | None = None
    ignore_eos: bool = False  # the reference stops on stop_token_ids only, as if True


@dataclass(frozen=True)
class RefLoRARequest:
    """``vllm.lora.request.LoRARequest``'s three positional fields."""

    lora_name: str
    lora_int_id: int
    lora_path: str


REFERENCE_API = SimpleNamespace(
    SamplingParams=lambda **kw: RefSamplingParams(**{**kw, "stop_token_ids": tuple(kw.get("stop_token_ids", ()))}),
    LoRARequest=RefLoRARequest,
)


class ReferenceEngine:
    """``vllm.LLM.generate`` for :class:`VLLMBackend` on CPU: adapters read back from their directories.

    Holds its own copy of the model (``load_policies(config)``), loads the
    request's adapter from ``lora_path`` into that copy's slot ``A`` (the
    base: adapters off) and samples with agonlib's decode loop, the engine
    ``decode_forward`` picks and the request's seeds, so on the same weights it
    returns exactly the transformers path's tokens. ``loaded`` records each ``(lora_int_id, lora_path)`` it read, in
    order, and ``calls`` every request, for the tests.
    """

    kind = "reference"
    logprobs_mode = "raw_logprobs"

    def __init__(self, config):
        self.policies = load_policies(config)
        self.cached: dict[int, str] = {}  # lora_int_id -> path, like vLLM's adapter cache
        self.slot_id = None
        self.loaded: list[tuple[int, str]] = []
        self.calls: list[tuple[object, list]] = []

    def reset(self) -> None:
        """Forget every adapter: a new backend numbers its requests from 1 again."""
        self.cached.clear()
        self.slot_id = None

    def _load(self, request) -> None:
        if self.cached.setdefault(request.lora_int_id, request.lora_path) != request.lora_path:
            raise ValueError(f"lora_int_id {request.lora_int_id} reused for another path: vLLM would serve stale weights.")
        if self.slot_id == request.lora_int_id:
            return
        state = load_file(str(Path(request.lora_path) / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.policies.model, state, adapter_name="A")
        missing = [k for k in result.missing_keys if "lora_" in k and ".A." in k]
        if missing:
            raise RuntimeError(f"adapter at {request.lora_path} lacks {len(missing)} weights, e.g. {missing[0]}.")
        self.slot_id = request.lora_int_id
        self.loaded.append((request.lora_int_id, request.lora_path))

    @torch.no_grad()
    def generate(self, requests, sampling_params, lora_request=None, use_tqdm=False):
        self.calls.append((lora_request, list(sampling_params)))
        if lora_request is not None:
            self._load(lora_request)
        slot = "A" if lora_request is not None else None
        first = sampling_params[0]
        params = SamplingParams(first.temperature, first.top_p, max(first.top_k, 0), first.max_tokens)
        pol = self.policies
        prompts, rows = distinct([tuple(r["prompt_token_ids"]) for r in requests])
        stops = list(first.stop_token_ids)
        engine = engine_for(pol, slot)
        # Whole prompts in one prefill, as this stand-in always did: sharing prefixes as the transformers path
        # does would change float rounding, and with it sampled tokens on SmolLM2.
        with engine.active():
            new = decode_batch(engine, [list(p) for p in prompts], [sp.seed for sp in sampling_params], params, stops,
                               pol.tokenizer.pad_token_id, rows=rows, share_prefixes=False)
        outputs = []
        for i, row in enumerate(rows):
            p = prompts[row]
            tokens, truncated = complete(new[i].tolist(), stops)  # vLLM stops at stop tokens only
            full = torch.tensor([list(p) + tokens])
            with pol.use(slot):
                lp = completion_logprobs(pol.model, full, torch.ones_like(full), len(p), 1.0)[0].tolist()
            logprobs = [{t: SimpleNamespace(logprob=v, rank=1)} for t, v in zip(tokens, lp)]
            outputs.append(SimpleNamespace(prompt_token_ids=list(p), outputs=[SimpleNamespace(
                token_ids=tokens, finish_reason="length" if truncated else "stop", stop_reason=None,
                logprobs=logprobs if first.logprobs is not None else None)]))
        return outputs
