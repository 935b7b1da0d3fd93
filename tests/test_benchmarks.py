"""The benchmark's arithmetic that its results rest on (the timings themselves are measured, not tested)."""

from types import SimpleNamespace

import torch

from benchmarks.run import _decode_bytes


def test_decode_bytes_counts_every_weight_per_step_and_each_rows_keys_and_values_so_far():
    model = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)  # 16 base parameters
    model.config = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    policies = SimpleNamespace(model=model, dtype=torch.bfloat16)
    rollouts = [SimpleNamespace(prompt_ids=[1, 2, 3], completion_ids=[7, 8]),
                SimpleNamespace(prompt_ids=[1, 2, 3, 4, 5], completion_ids=[])]
    # Weights: 16 × 2 bytes, read at each of 2 steps. Keys and values: 2 layers × (k, v) × 1 head × 4 dims × 2 bytes
    # = 32 bytes a position. The first row's first token comes from the prefill; its one decode step reads the
    # prompts' width (5, padded) + 1 positions. The second row drew no token: it never decodes.
    assert _decode_bytes(policies, rollouts, decode_steps=2) == 2 * 32 + 6 * 32
    rollouts[1].completion_ids = [4, 4, 4]  # three tokens: decode steps read 6 and 7 positions
    assert _decode_bytes(policies, rollouts, decode_steps=2) == 2 * 32 + (6 + 6 + 7) * 32
