"""The generation package's shape (issue 13): one decode loop over an engine interface, old names kept.

The loop runs here on a scripted engine — each completion's tokens fixed in
advance — so what it does with rows is exact: which rows a step feeds, when
finished rows leave (``evict_at``), where completions stop. The engines
themselves are checked against the ``transformers`` forward in
``tests/test_decode.py`` and ``tests/test_rollouts.py``.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch

import agonlib
from agonlib.generation import SamplingParams, engines
from agonlib.generation.loop import decode_batch

PAD, STOP, FILL, VOCAB = 0, 1, 2, 8


class ScriptedEngine:
    """Puts all probability on ``scripts[prompt][t]`` for each batch row; records what the loop asks of it."""

    shares_prefixes = False
    evict_at = 0.0
    device = torch.device("cpu")

    def __init__(self, scripts):
        self.scripts, self.selects, self.fed = scripts, [], []

    def _logits(self):
        logits = torch.full((len(self.rows), VOCAB), float("-inf"))
        for i, row in enumerate(self.rows.tolist()):
            script = self.scripts[row]
            logits[i, script[self.t] if self.t < len(script) else FILL] = 0.0
        return logits

    def prefill(self, input_ids, attention_mask, max_new_tokens, prefix=None):
        self.rows, self.t = torch.arange(len(input_ids)), 0  # the prompt behind each batch row
        return self._logits()

    def select(self, rows):
        self.selects.append(rows.tolist())
        self.rows = self.rows[rows]

    def step(self, next_ids):
        self.fed.append(next_ids[:, 0].tolist())
        self.t += 1
        return self._logits()


SCRIPTS = [[3, 3, STOP], [4, STOP], [5, 5, 5, 5, 5, 5], [STOP]]  # stops at 3, 2, never, 1


@pytest.mark.parametrize("evict_at, feeds", [
    # 0: a finished row leaves at once (the transformers engine's default)
    (0.0, [[3, 4, 5], [3, 5], [5], [5], [5]]),
    # 0.5: finished rows ride along (fed their stop token, then padding) until half the batch has finished
    (0.5, [[3, 4, 5, STOP], [3, 5], [5], [5], [5]]),
    # 1: nothing leaves until every row has finished
    (1.0, [[3, 4, 5, STOP], [3, STOP, 5, PAD], [STOP, PAD, 5, PAD], [PAD, PAD, 5, PAD], [PAD, PAD, 5, PAD]]),
])
def test_finished_rows_leave_at_the_eviction_threshold(evict_at, feeds):
    engine = ScriptedEngine(SCRIPTS)
    tokens = decode_batch(engine, [[9]] * 4, [1, 2, 3, 4], SamplingParams(max_new_tokens=6), [STOP], PAD,
                          evict_at=evict_at)
    assert engine.fed == feeds
    # whatever the threshold, every completion draws the same tokens and stops where its script does
    assert tokens.tolist() == [[3, 3, STOP, PAD, PAD, PAD], [4, STOP, PAD, PAD, PAD, PAD], [5] * 6,
                               [STOP, PAD, PAD, PAD, PAD, PAD]]


def test_a_repeated_prompt_is_prefilled_once_and_copied():
    engine = ScriptedEngine([[3, STOP], [4, 4, STOP]])
    tokens = decode_batch(engine, [[9], [8]], [1, 2, 3], SamplingParams(max_new_tokens=4), [STOP], PAD,
                          rows=[1, 0, 1])
    assert engine.selects[0] == [1, 0, 1]  # the prefill's 2 prompt rows become 3 completion rows
    assert tokens.tolist() == [[4, 4, STOP], [3, STOP, PAD], [4, 4, STOP]]


def test_the_engines_default_thresholds():
    # Pinned: when finished rows leave decides the batches a decode step multiplies, and in bf16 a batch's size
    # changes the rounding of what a row samples (experiments/LOG.md, 2026-12-06): the committed bf16 runs
    # regenerate bit for bit only with these thresholds.
    assert engines.TransformersEngine.evict_at == 0.0 and not engines.TransformersEngine.shares_prefixes
    assert engines.FastEngine.evict_at == 0.25 and engines.FastEngine.shares_prefixes


def test_the_transformers_engine_follows_the_cache_the_model_returns():
    """Unsloth's patched forward returns a new legacy tuple cache every step; the next step must get it."""
    seen = []

    def model(input_ids, attention_mask, position_ids, use_cache=True, past_key_values=None, logits_to_keep=None):
        seen.append(past_key_values)
        grown = ((torch.zeros(len(input_ids), 1, attention_mask.shape[1], 1),) * 2,)  # (b, heads, T, d)
        return SimpleNamespace(logits=torch.zeros(len(input_ids), 1, VOCAB), past_key_values=grown)

    policies = SimpleNamespace(model=model, device=torch.device("cpu"), use=None)
    engine = engines.TransformersEngine(policies, None)
    engine.prefill(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), 4)
    engine.step(torch.ones(2, 1, dtype=torch.long))
    engine.step(torch.ones(2, 1, dtype=torch.long))
    assert [c[0][0].shape[2] for c in seen[1:]] == [3, 4]  # each step saw the cache of the step before


# --- old module names --------------------------------------------------------------------------


@pytest.mark.parametrize("old, new", [
    ("agonlib.rollouts", "agonlib.generation"),
    ("agonlib.decode", "agonlib.generation.fast"),
    ("agonlib.backends", "agonlib.generation.backends"),
    ("agonlib.vllm_reference", "agonlib.generation.vllm_reference"),
    ("agonlib.results", "agonlib.study.results"),
])
def test_old_module_names_import_the_moved_module(old, new):
    moved = importlib.import_module(new)
    assert importlib.import_module(old) is moved  # the same object: patching one patches the other
    assert getattr(agonlib, old.rpartition(".")[2]) is moved
    assert moved.__spec__.name == new  # the module keeps its own identity


def test_from_old_names_import_works():
    from agonlib.backends import VLLMBackend
    from agonlib.decode import FastDecoder
    from agonlib.rollouts import GenerationStats, SamplingParams, generate, share_prefixes  # noqa: F401

    assert VLLMBackend is agonlib.generation.backends.VLLMBackend
    assert FastDecoder is agonlib.generation.fast.FastDecoder
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("agonlib.not_a_module")


def test_policies_name_their_model_loader_once(smoke_policies):
    assert smoke_policies.model_loader == "transformers" and not hasattr(smoke_policies, "backend")  # one name
