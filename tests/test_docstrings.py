"""The worked examples in docstrings (``>>>``) run as written: a stale example fails here."""

import doctest
import importlib
from pathlib import Path

import pytest

import agonlib

ROOT = Path(agonlib.__file__).parent
MODULES = sorted(".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
                 for p in ROOT.rglob("*.py") if ">>>" in p.read_text())


def test_the_examples_are_found():
    assert {"agonlib.evaluation", "agonlib.parsing", "agonlib.study.verdict"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has '>>>' but no example doctest could find"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (output above)"
