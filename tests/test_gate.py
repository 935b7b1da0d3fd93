"""The gate (agonlib.gate, DESIGN.md §8): pairs of the untrained adapters, three challenge conditions."""

import json
from pathlib import Path

import pytest

import agonlib
from agonlib import gate
from agonlib.__main__ import main
from agonlib.models import pick_device, pick_dtype


def test_gate_on_the_tiny_model(smoke_policies, tmp_path):
    config = agonlib.load_config("smoke", device="cpu", dtype="float32", gate_problems=2,
                                 challenger_max_new_tokens=5)
    result = gate.run_gate(config, smoke_policies, progress=False)
    assert result["n_pairs"] == 2 * config.num_generations
    for name in ("drafts", *gate.CONDITIONS):
        for key in ("boxed_rate", "truncation_rate", "accuracy"):
            assert 0.0 <= result[name][key] <= 1.0
    assert result["competitive"]["len_mean"] <= 5  # the challenger's own cap
    assert {e["condition"] for e in result["examples"]} == set(gate.CONDITIONS)
    # a random tiny model never boxes: the gate must say it fails, and why
    assert not result["passed"] and any("boxes" in m for m in result["misses"])
    path = gate.write_gate(result, tmp_path / "smoke.json")
    cached, rerun = gate.cached_gate(config, path)
    assert not rerun and cached["fingerprint"] == gate.fingerprint(config)
    assert gate.fingerprint(config.replace(challenger_max_new_tokens=6)) != gate.fingerprint(config)
    assert gate.fingerprint(config.replace(summary_mask="derived")) != gate.fingerprint(config)


def test_gate_fingerprint_names_the_dtype_the_machine_resolves():
    """``dtype: auto`` is bf16 on one CPU and fp32 on another: a gate measured in one must not stand for the other."""
    config = agonlib.load_config("cpu")
    resolved = str(pick_dtype("auto", pick_device(config.device))).removeprefix("torch.")
    assert gate.fingerprint(config.replace(dtype="auto")) == gate.fingerprint(config.replace(dtype=resolved))
    assert gate.fingerprint(config.replace(dtype="float32")) != gate.fingerprint(config.replace(dtype="bfloat16"))
    # one file per dtype: a bf16 machine neither reuses nor overwrites the float32 gate
    assert gate.gate_path("cpu", "g") == gate.gate_path("cpu", "g", "float32") == Path("g/cpu.json")
    assert gate.gate_path("cpu", "g", "bfloat16") == Path("g/cpu-bfloat16.json")
    expected = "cpu.json" if resolved == "float32" else f"cpu-{resolved}.json"  # this machine's own file
    assert gate.gate_path("cpu", dtype=gate.resolved_dtype(config)) == gate.GATE_DIR / expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_committed_gates_match_their_dtype(dtype):
    """Each committed gate was measured with this commit's prompts and settings in its dtype, and passed."""
    found = json.loads(gate.gate_path("cpu", dtype=dtype).read_text())
    config = agonlib.load_config("cpu", dtype=dtype)
    assert found["fingerprint"] == gate.fingerprint(config) and found["passed"]


def _result(**conditions):
    base = {"boxed_rate": 0.9, "truncation_rate": 0.05, "accuracy": 0.2}
    return {name: {**base, **conditions.get(name, {})} for name in gate.CONDITIONS}


@pytest.mark.parametrize("conditions,missed", [
    # every goal met
    ({}, []),
    # the summary hurts: competitive accuracy below no exchange
    ({"competitive": {"accuracy": 0.1}}, ["competitive: accuracy"]),
    # a cooperative challenger that rarely boxes and runs into its cap
    ({"cooperative": {"boxed_rate": 0.5, "truncation_rate": 0.3}}, ["cooperative: the challenger boxes",
                                                                     "cooperative: 0.30 of challenges"]),
    # no exchange is not held to the format goals (it is the drafter's own prompt)
    ({"no_exchange": {"boxed_rate": 0.1}}, []),
])
def test_gate_verdict_table(conditions, missed):
    misses = gate.verdict(_result(**conditions))
    assert len(misses) == len(missed) and all(m.startswith(prefix) for m, prefix in zip(misses, missed))


def test_gate_command_writes_its_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    code = main(["gate", "--profile", "smoke", "--set", "gate_problems=1", "--set", "device=cpu",
                 "--set", "max_new_tokens=4", "--out", str(out)])
    assert code == 0  # without --strict a failed gate is reported, not an error
    result = json.loads(out.read_text())
    assert result["profile"] == "smoke" and result["n_pairs"] == 2
    assert "Gate (smoke)" in capsys.readouterr().out
