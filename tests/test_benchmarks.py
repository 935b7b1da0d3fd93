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


def test_compile_section_brackets_the_compiled_process_with_two_eager_ones_and_reports_their_ratio(monkeypatch):
    from benchmarks import run

    calls = []

    def child(tree, kind, args, *flags):
        compiled = "--compile" in flags
        calls.append(compiled)
        first, later = (30.0, 6.0) if compiled else (10.0, 9.0 if len(calls) == 1 else 7.0)
        steps = [{"update_s": first, "generation_s": 1.0}, {"update_s": later, "generation_s": 1.0}]
        return {"steps": steps, "warm": {"update_s": later}, "peak_rss_mib": 1.0, "dtype": "bfloat16"}

    monkeypatch.setattr(run, "_step_child", child)
    out = run.bench_compile(SimpleNamespace(train_steps=2))
    assert calls == [False, True, False]
    assert out["warm_update_speedup"] == round(8.0 / 6.0, 3)  # the two eager processes' mean, 9 and 7
    assert out["first_step_extra_s"] == 20.0
    machine = {"cpu": "x", "cores": 2, "torch": "t", "torch_threads": 1, "avx512": True, "avx512_bf16": True,
               "load_avg_1m": 0.0}
    text = run.markdown({"date": "d", "machine": machine, "compile": out})
    assert "| compiled | 30.0, 6.0 | 6.0 |" in text and "**1.333×**" in text
    assert "compile" not in run.SECTIONS  # opt-in: the default run leaves it out
