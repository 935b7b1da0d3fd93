"""The README's Python API section runs as written (issue 13, item 8): every call, on the smoke profile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def api_block() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    match = re.search(r"````python\n(.*?)\n````", section, re.DOTALL)
    assert match, "README's Python API section has no ````python block"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_python_api_runs_as_written(tmp_path):
    code = api_block().replace("/tmp/agon-api", str(tmp_path))
    assert str(tmp_path) in code  # the block writes only under its own folder
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - our own README
    assert scope["answer"] == "7" and scope["math_ok"] == 1 and scope["code_ok"] == 1
    run_dir = Path(scope["run_dir"])
    final = json.loads((run_dir / "final_eval.json").read_text())
    assert {"base", "A", "cascade_AB"} <= set(final)
    assert set(scope["table"]["system"]) >= {"base", "A", "cascade_AB"}
    assert list((tmp_path / "figures" / "smoke").glob("*.png"))


def test_the_api_block_calls_every_public_function():
    code = api_block()
    for call in ("load_config", "load_policies", "split_completion", "grade_math", "grade_code", "train(",
                 "evaluate(", "results.collect", "plots.make_figures"):
        assert call in code, call
