"""Generation: one decode loop over engines, and the backends that sample a step's rollouts.

::

    rollouts.py       generate(policies, prompts, adapter, seeds) -> [Rollout]; Settings, batch sizing
    loop.py           decode_batch: the one decode loop (seeds, stops, eviction of finished rows)
    engines.py        TransformersEngine (the PEFT forward), FastEngine; engine_for (``decode_forward``)
    fast.py           FastDecoder: one adapter merged into fused weights, a preallocated KV cache
    sampling.py       SamplingParams, sample_seed, draw (temperature, top-k, top-p, inverse CDF)
    stops.py          stop tokens and stop-at-answer (AnswerStop, complete), for every engine
    layout.py         distinct prompts, left cut, left padding, shared prefixes
    backends.py       TransformersBackend, VLLMBackend (two LoRA adapters over one base); ``generation_engine``
    vllm_reference.py ReferenceEngine: a CPU stand-in for vllm.LLM (tests, gpu_check --dry-run)

The package exports what ``agonlib.rollouts`` did (that old name still imports
it). ``backends`` and ``vllm_reference`` are imported on their own: they read
the training log-probs from ``agonlib.grpo``, which imports this package.
"""

from .layout import MIN_SHARED, SharedPrefix, prompt_layout, share_prefixes
from .rollouts import KV_MEMORY_SHARE, GenerationStats, Rollout, Settings, generate, kv_bytes_per_token, rows_that_fit
from .sampling import SamplingParams, draw, sample_seed, warp_logits
from .stops import AnswerStop, answer_stop_for, complete, has_answer

__all__ = ["KV_MEMORY_SHARE", "MIN_SHARED", "AnswerStop", "GenerationStats", "Rollout", "SamplingParams", "Settings",
           "SharedPrefix", "answer_stop_for", "complete", "draw", "generate", "has_answer", "kv_bytes_per_token",
           "prompt_layout", "rows_that_fit", "sample_seed", "share_prefixes", "warp_logits"]
