"""Problem sets: synthetic generator, hub loaders on fixture files, hand-written code problems.

Nothing is downloaded: hub loaders read small parquet/jsonl files that each
test writes in the hub schema under tmp_path.
"""

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before anything imports datasets / huggingface_hub
os.environ["HF_HUB_OFFLINE"] = "1"

import dataclasses  # noqa: E402
from fractions import Fraction  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from agonlib.data.code_problems import REFERENCE_SOLUTIONS, code_problems  # noqa: E402
from agonlib.data.codecontests import collect_tests, load_code_contests  # noqa: E402
from agonlib.data import (  # noqa: E402
    DEEPMATH,
    gsm8k_final_answer,
    load_aime2024,
    load_deepmath_hard,
    load_gsm8k,
    load_math500,
    load_problems,
)
from agonlib.data.hub import DataLoadError, hub_rows, normalize_answer, split_by_question  # noqa: E402
from agonlib.data.synthetic import LEVELS, solve, synthetic_problems, synthetic_split  # noqa: E402

ROW_KEYS = {"id", "question", "answer", "difficulty", "source"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Stay offline even if another test module imported the hub libraries first."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- synthetic ------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_ignores_global_rng():
    random.seed(1)
    a = synthetic_problems(40, levels=LEVELS, seed=3)
    random.seed(2)
    b = synthetic_problems(40, levels=LEVELS, seed=3)
    assert a == b
    assert synthetic_problems(40, levels=LEVELS, seed=4) != a  # another seed, other problems
    assert synthetic_problems(10, levels=LEVELS, seed=3) == a[:10]  # a shorter list is a prefix


def test_synthetic_rows_levels_and_answers():
    rows = synthetic_problems(100, levels=LEVELS, seed=0)
    json.dumps(rows)  # JSON-serialisable
    assert {r["difficulty"] for r in rows} == set(LEVELS)
    assert len({r["question"] for r in rows}) == len(rows)  # no repeated question
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert ROW_KEYS <= set(r) and r["source"] == "synthetic"
        assert r["id"] == f"syn-train-L{r['difficulty']}-0-{r['id'].rsplit('-', 1)[1]}"
        value = int(r["answer"])  # an exact integer, written as a plain integer string
        assert r["answer"] == str(value) and value >= 0
        start = r["work"]["start"]  # the story's quantities, folded here with exact fractions
        amount = Fraction(start[1] * start[2] if start[0] == "groups" else start[1])
        for op, k in r["work"]["ops"]:
            amount = {"add": amount + k, "sub": amount - k, "mul": amount * k, "div": amount / k}[op]
            assert amount.denominator == 1 and amount >= 0  # every step of the story is a whole count
        assert value == amount == solve(r["work"])
        for _, k in r["work"]["ops"]:  # the story states every operand
            assert str(k) in r["question"] or k in (2, 3)  # 2 and 3 may read "twice" / "three times"


# (level, steps in the structured form)
@pytest.mark.parametrize("level, steps", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 4)])
def test_synthetic_levels_grade_steps(level, steps):
    rows = synthetic_problems(20, levels=(level,), seed=0)
    assert all(len(r["work"]["ops"]) == steps for r in rows)
    if level == 1:
        assert all(r["work"]["ops"][0][0] in ("add", "sub") and int(r["answer"]) <= 20 for r in rows)


def test_synthetic_split_is_disjoint():
    train, test = synthetic_split(300, 60, levels=(1, 2), seed=0)
    assert (len(train), len(test)) == (300, 60)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    # via load_problems: a train set built against test_size=60 misses the test set
    tr = load_problems("synthetic", "train", n=300, levels=(1, 2), test_size=60)
    te = load_problems("synthetic", "test", n=40, levels=(1, 2), test_size=60)
    assert not {r["question"] for r in tr} & {r["question"] for r in te}
    assert tr == train and te == test[:40]


def test_synthetic_bad_levels():
    with pytest.raises(ValueError, match="subset of"):
        synthetic_problems(3, levels=(0, 6))


# --- answers ------------------------------------------------------------------------

# (raw, thousands, normalised)
ANSWER_CASES = [
    ("033", False, "33"),  # AIME leading zeros
    ("27.0", False, "27"),  # integer written as a float
    ("27.50", False, "27.50"),  # a real decimal is left alone
    ("-0", False, "0"),  # negative zero
    (" 7 ", False, "7"),  # whitespace
    ("$12$", False, "12"),  # inline math delimiters
    ("1,234", True, "1234"),  # GSM8K thousands separator
    ("1,234,567.0", True, "1234567"),  # separators and a float
    ("1,234", False, "1,234"),  # off by default (could be a list)
    ("\\frac{14}{3}", False, "\\frac{14}{3}"),  # LaTeX untouched
    (42, False, "42"),  # an int gold
]


@pytest.mark.parametrize("raw, thousands, expected", ANSWER_CASES)
def test_normalize_answer(raw, thousands, expected):
    assert normalize_answer(raw, thousands=thousands) == expected


# (GSM8K solution text, final answer)
GSM8K_CASES = [
    ("He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),  # plain
    ("Total is 1000 + 234.\n#### 1,234", "1234"),  # thousands separator
    ("#### 05", "5"),  # leading zero
    ("no final answer here", None),  # missing ####
    ("####   ", None),  # empty after ####
]


@pytest.mark.parametrize("solution, expected", GSM8K_CASES)
def test_gsm8k_final_answer(solution, expected):
    assert gsm8k_final_answer(solution) == expected


# --- DeepMath fixture -------------------------------------------------------------------


def deepmath_rows():
    def row(q, a, d, topic="Algebra"):
        return {"question": q, "final_answer": a, "difficulty": d, "topic": topic,
                "r1_solution_1": "long trace", "r1_solution_2": "long trace", "r1_solution_3": "long trace"}

    rows = [row(f"Hard problem {i}?", str(i), 7.0 + (i % 5) * 0.5) for i in range(30)]
    rows += [
        row("Easy problem?", "1", 5.0),  # below the threshold
        row("Medium problem?", "2", 6.5),  # below the threshold
        row("No answer?", None, 8.0),  # malformed: missing answer
        row("   ", "3", 8.0),  # malformed: empty question
        row("Unreadable gold?", "BAD", 8.0),  # the gold fails its self-check
        row("Hard problem 3?", "3", 7.5),  # a repeated question
    ]
    return rows


def fake_check(gold):
    return gold != "BAD"


def test_deepmath_filter_selfcheck_and_split(tmp_path):
    path = write_parquet(tmp_path / "train-00000-of-00001.parquet", deepmath_rows())
    parts = load_deepmath_hard(data_files=path, test_size=8, seed=0, self_check=fake_check)
    s = parts.stats
    assert s["rows_read"] == 36
    assert s["filtered/below_min_difficulty"] == 2
    assert s["malformed/missing_answer"] == 1 and s["malformed/empty_question"] == 1
    assert s["dropped/duplicate_question"] == 1 and s["dropped/self_check_failed"] == 1
    assert (s["kept"], s["train"], s["test"]) == (30, 22, 8)
    assert not {r["question"] for r in parts.train} & {r["question"] for r in parts.test}
    for r in parts.train + parts.test:
        assert ROW_KEYS <= set(r) and r["difficulty"] >= 7 and r["answer"] != "BAD"
        assert r["id"].startswith("deepmath-") and "r1_solution_1" not in r
    json.dumps(parts.train)
    # deterministic; another seed draws another test set
    again = load_deepmath_hard(data_files=path, test_size=8, seed=0, self_check=fake_check)
    assert (again.train, again.test) == (parts.train, parts.test)
    other = load_deepmath_hard(data_files=path, test_size=8, seed=1, self_check=fake_check)
    assert {r["id"] for r in other.test} != {r["id"] for r in parts.test}
    # the threshold is configurable
    harder = load_deepmath_hard(data_files=path, test_size=2, min_difficulty=8.5, self_check=False)
    assert all(r["difficulty"] >= 8.5 for r in harder.train + harder.test)


def test_deepmath_split_ignores_row_order(tmp_path):
    rows = deepmath_rows()
    a = load_deepmath_hard(data_files=write_parquet(tmp_path / "a.parquet", rows), test_size=5, self_check=False)
    b = load_deepmath_hard(data_files=write_parquet(tmp_path / "b.parquet", rows[::-1]), test_size=5,
                           self_check=False)
    assert [r["id"] for r in a.test] == [r["id"] for r in b.test]


@pytest.mark.parametrize("batched", [True, False])
def test_deepmath_default_self_check_uses_the_verifier(tmp_path, monkeypatch, batched):
    calls = []

    def grade_math(completion, gold, thinking=True):
        calls.append((completion, gold, thinking))
        return int(gold != "BAD")

    def grade_math_batch(completions, golds, thinking=True):
        return [grade_math(c, g, thinking) for c, g in zip(completions, golds)]

    fake = types.SimpleNamespace(grade_math=grade_math)
    if batched:
        fake.grade_math_batch = grade_math_batch
    monkeypatch.setitem(sys.modules, "agonlib.grading.math_grader", fake)
    path = write_parquet(tmp_path / "d.parquet", deepmath_rows())
    parts = load_deepmath_hard(data_files=path, test_size=4)
    assert parts.stats["dropped/self_check_failed"] == 1
    assert ("\\boxed{5}", "5", False) in calls and len(calls) == 31


def test_deepmath_self_check_with_real_verifier(tmp_path):
    pytest.importorskip("math_verify")
    rows = [{"question": f"Q{i}?", "final_answer": gold, "difficulty": 8.0, "topic": "t"}
            for i, gold in enumerate(["\\frac{1}{2}", "42", "x^2 + 1", "\\sqrt{2}"])]
    parts = load_deepmath_hard(data_files=write_jsonl(tmp_path / "d.jsonl", rows), test_size=1)
    assert parts.stats["dropped/self_check_failed"] == 0 and parts.stats["kept"] == 4


def test_deepmath_via_load_problems(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", deepmath_rows())
    kw = dict(data_files=path, test_size=6, self_check=fake_check)
    test = load_problems("deepmath", "test", **kw)
    train = load_problems("deepmath", "train", n=5, **kw)
    assert len(test) == 6 and len(train) == 5
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    with pytest.raises(ValueError, match="lower test_size"):
        load_problems("deepmath", "test", data_files=path, test_size=100, self_check=False)


def test_hub_layout_projects_columns(tmp_path):
    """A folder laid out like the hub repo (README metadata + data/train-*.parquet) goes
    through the same load_dataset(repo, columns=...) call as the real id."""
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data" / "train-00000-of-00001.parquet", deepmath_rows())
    features = "".join(f"  - name: {c}\n    dtype: {'float64' if c == 'difficulty' else 'string'}\n"
                       for c in deepmath_rows()[0])
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                        f"    path: data/train-*\ndataset_info:\n  features:\n{features}---\n")
    rows = list(hub_rows(dataclasses.replace(DEEPMATH, repo_id=str(tmp_path))))
    assert len(rows) == len(deepmath_rows()) and set(rows[0]) == {"question", "final_answer", "difficulty", "topic"}


def test_hub_without_network_fails_clearly():
    with pytest.raises(DataLoadError, match="network access"):
        load_aime2024()


# --- evaluation sets ------------------------------------------------------------------


def test_math500_jsonl(tmp_path):
    rows = [
        {"problem": "Compute 1/2 + 0.", "solution": "...", "answer": "\\frac{1}{2}", "subject": "Algebra",
         "level": 2, "unique_id": "test/algebra/1.json"},
        {"problem": "How many?", "solution": "...", "answer": "27.0", "subject": "Counting", "level": 5,
         "unique_id": "test/counting/7.json"},
        {"problem": "", "solution": "...", "answer": "1", "subject": "x", "level": 1, "unique_id": "u3"},  # empty
        {"problem": "No answer", "solution": "...", "answer": None, "subject": "x", "level": 1, "unique_id": "u4"},
    ]
    stats = {}
    out = load_math500(data_files=write_jsonl(tmp_path / "test.jsonl", rows), stats=stats)
    assert [r["answer"] for r in out] == ["\\frac{1}{2}", "27"]
    assert [r["id"] for r in out] == ["math500-test/algebra/1", "math500-test/counting/7"]
    assert [r["difficulty"] for r in out] == [2, 5]
    assert stats == {"kept": 2, "malformed/empty_question": 1, "malformed/missing_answer": 1}


def test_gsm8k_parquet(tmp_path, caplog):
    rows = [
        {"question": "Q1?", "answer": "work\n#### 1,200"},
        {"question": "Q2?", "answer": "work\n#### 033"},
        {"question": "Q3?", "answer": "no marker"},  # malformed: no ####
    ]
    stats = {}
    out = load_gsm8k("test", data_files=write_parquet(tmp_path / "test.parquet", rows), stats=stats)
    assert [(r["id"], r["answer"]) for r in out] == [("gsm8k-test-0", "1200"), ("gsm8k-test-1", "33")]
    assert stats["malformed/missing_answer"] == 1
    assert "skipped" in caplog.text and "malformed/missing_answer: 1" in caplog.text  # logged, not silent


def test_aime2024_and_sampling(tmp_path):
    rows = [{"id": 60 + i, "problem": f"AIME problem {i}", "solution": "...", "answer": f"{i:03d}",
             "url": "u", "year": "2024"} for i in range(10)]
    path = write_parquet(tmp_path / "aime.parquet", rows)
    out = load_aime2024(data_files=path)
    assert out[3] == {"id": "aime2024-63", "question": "AIME problem 3", "answer": "3", "difficulty": None,
                      "source": "aime2024"}
    sample = load_problems("aime2024", "test", n=4, seed=1, data_files=path)
    assert len(sample) == 4 and sample == load_aime2024(n=4, seed=1, data_files=path)
    assert [r["id"] for r in sample] == sorted(r["id"] for r in sample)  # original order kept


# --- CodeContests fixture --------------------------------------------------------------


def cc_row(name, *, description="Read n, print n+1.", public=(("1\n", "2\n"),), private=(), generated=(),
           languages=(3,), rating=1200, difficulty=7, input_file="", output_file=""):
    def block(pairs):
        return {"input": [p[0] for p in pairs], "output": [p[1] for p in pairs]}

    return {"name": name, "description": description, "public_tests": block(public),
            "private_tests": block(private), "generated_tests": block(generated), "source": 2,
            "difficulty": difficulty, "solutions": {"language": list(languages), "solution": ["x"] * len(languages)},
            "incorrect_solutions": {"language": [], "solution": []}, "cf_contest_id": 1, "cf_index": "A",
            "cf_points": 500.0, "cf_rating": rating, "cf_tags": ["math"], "is_description_translated": False,
            "untranslated_description": "", "time_limit": {"seconds": 2, "nanos": 500000000},
            "memory_limit_bytes": 256000000, "input_file": input_file, "output_file": output_file}


CC_ROWS = [
    cc_row("1000_A. Good", private=(("1\n", "2\n"), ("5\n", "6\n")), generated=(("7\n", "8\n"), ("9\n", "10\n"))),
    cc_row("1000_B. File input", input_file="input.txt"),  # file I/O field
    cc_row("1000_C. File mention", description="Read from input.txt and write to output.txt."),  # file I/O text
    cc_row("1000_D. Cpp only", languages=(2, 4)),  # no Python 3 solution
    cc_row("1000_E. No tests", public=()),  # nothing to grade with
    cc_row("1000_F. Too hard", rating=3000, difficulty=12),  # rating above the range
    cc_row("p0001 Unrated", rating=0, difficulty=0),  # no rating
    cc_row("1000_G. Empty", description="  "),  # malformed
    cc_row("1000_H. Big test", public=(("x" * 100, "y\n"),), difficulty=8),  # only an oversized test
]


def test_code_contests_filters(tmp_path):
    path = write_parquet(tmp_path / "train-00000.parquet", CC_ROWS)
    stats = {}
    out = load_code_contests("train", data_files=path, max_rating=2000, max_tests=3, max_test_chars=50,
                             stats=stats)
    assert [r["id"] for r in out] == ["cc-train-1000_A"]
    good = out[0]
    assert good["answer"] is None and good["difficulty"] == 1200 and good["time_limit_s"] == 2.5
    # public first, repeated input dropped, capped at 3
    assert good["tests"] == [{"input": "1\n", "output": "2\n"}, {"input": "5\n", "output": "6\n"},
                             {"input": "7\n", "output": "8\n"}]
    assert stats == {"kept": 1, "filtered/file_io": 2, "filtered/no_python3_solution": 1, "filtered/no_tests": 2,
                     "filtered/rating_out_of_range": 1, "filtered/no_rating": 1, "malformed/empty_question": 1}
    json.dumps(out)


def test_code_contests_difficulty_labels_and_cap(tmp_path):
    path = write_parquet(tmp_path / "train-00000.parquet", CC_ROWS)
    by_name = load_code_contests("train", data_files=path, difficulties=["A"])
    by_int = load_code_contests("train", data_files=path, difficulties=[7])
    assert by_name == by_int and {r["id"] for r in by_name} == {"cc-train-1000_A"}
    unrated = load_code_contests("train", data_files=path, require_python=False)
    assert "cc-train-p0001_Unrated" in {r["id"] for r in unrated}  # no rating filter: unrated kept
    assert len(load_code_contests("train", data_files=path, n=1, require_python=False)) == 1
    with pytest.raises(ValueError, match="Unknown CodeContests difficulty"):
        load_code_contests("train", data_files=path, difficulties=["EASYISH"])


def test_collect_tests_skips_non_strings():
    raw = {"public_tests": {"input": ["1\n", None], "output": ["2\n", "3\n"]}}
    assert collect_tests(raw) == [{"input": "1\n", "output": "2\n"}]


# --- hand-written code problems ---------------------------------------------------------


def test_code_problems_shape():
    rows = code_problems()
    assert len(rows) >= 8 and len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert ROW_KEYS | {"tests"} == set(r) and r["answer"] is None
        assert 3 <= len(r["tests"]) <= 5 and r["id"] in REFERENCE_SOLUTIONS
        assert "solution" not in json.dumps(r)  # the reference never reaches a prompt
    assert load_problems("code_handwritten", "test", n=2) == rows[:2]


@pytest.mark.parametrize("row", code_problems(), ids=lambda r: r["id"])
def test_reference_solutions_pass_their_tests(row):
    for test in row["tests"]:
        done = subprocess.run([sys.executable, "-I", "-c", REFERENCE_SOLUTIONS[row["id"]]], input=test["input"],
                              capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == test["output"].split(), (test, done.stdout)


# --- dispatcher ---------------------------------------------------------------------------


# (source, split, error fragment)
DISPATCH_ERRORS = [
    ("deepmat", "train", "Did you mean 'deepmath'"),  # typo: nearest source suggested
    ("mnist", "train", "Valid sources: synthetic, deepmath"),  # unknown: every source listed
    ("math500", "train", "no 'train' split"),  # eval-only source
    ("synthetic", "validation", "use one of train, test"),  # unknown split
]


@pytest.mark.parametrize("source, split, message", DISPATCH_ERRORS)
def test_load_problems_errors(source, split, message):
    with pytest.raises(ValueError, match=message):
        load_problems(source, split)


# (source, keyword that source does not take, a keyword it does take)
UNKNOWN_KEYWORDS = [
    ("synthetic", "min_difficulty", "levels, test_size"),  # a DeepMath option passed to synthetic
    ("deepmath", "levels", "min_difficulty, test_size, self_check"),  # a synthetic option passed to DeepMath
    ("code_handwritten", "test_size", "none"),  # the hand-written set takes no options
    ("codecontests", "max_ratin", "max_rating"),  # a typo
]


@pytest.mark.parametrize("source, keyword, accepted", UNKNOWN_KEYWORDS)
def test_load_problems_rejects_unknown_keywords(source, keyword, accepted):
    with pytest.raises(TypeError, match=f"unexpected keyword.*{keyword}.*{accepted}"):
        load_problems(source, "test", **{keyword: 1})


def test_split_by_question_dedupes():
    rows = [{"question": q, "id": str(i)} for i, q in enumerate(["a", "b", "a ", "c", "d"])]
    train, test = split_by_question(rows, 2, seed=0)
    assert len(train) + len(test) == 4 and not {r["question"].strip() for r in train} & {
        r["question"].strip() for r in test}
