"""GSM8K-style JSONL/Parquet: kept rows, malformed-row counting, strict errors, numeric rewards."""

import json
import sys

import pytest

from sparserl_jax.data import DataConfig, DataError, gsm8k_reward, load_file_examples

GOOD = [
    {"question": "Q1?", "answer": "Natalia sold 48/2 = 24 clips.\n#### 72"},
    {"question": "Q2?", "answer": "#### 1,234"},
    {"question": "Q3?", "answer": 5},
    {"question": "Q4?", "answer": "-2.5"},
]


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _messy_jsonl(tmp_path):
    lines = [
        json.dumps(GOOD[0]),  # 1
        "{not json",  # 2 bad_json
        json.dumps(GOOD[1]),  # 3
        "",  # 4 blank: skipped, not a row
        json.dumps({"question": "no answer"}),  # 5 missing_field
        json.dumps({"question": "Q?", "answer": "about seven"}),  # 6 non_numeric_answer
        json.dumps([1, 2]),  # 7 not_an_object
        json.dumps(GOOD[2]),  # 8
        json.dumps({"question": "", "answer": "3"}),  # 9 bad_question
        json.dumps({"question": "Q?", "answer": None}),  # 10 missing_field
        json.dumps(GOOD[3]),  # 11
    ]
    return _write_jsonl(tmp_path / "train.jsonl", lines)


def test_jsonl_counts_malformed_rows(tmp_path):
    path = _messy_jsonl(tmp_path)
    cfg = DataConfig(task="gsm8k", path=path, prompt_template="Question: {question}\nAnswer:")
    examples, report = load_file_examples(cfg, path)
    assert [e.answer for e in examples] == ["72", "1234", "5", "-2.5"]
    assert [e.prompt for e in examples][0] == "Question: Q1?\nAnswer:"
    assert [e.source for e in examples] == [f"{path}:{n}" for n in (1, 3, 8, 11)]
    assert [e.index for e in examples] == [0, 1, 2, 3]
    assert examples[0].completion == GOOD[0]["answer"]  # `####` reasoning doubles as SFT text
    assert examples[2].completion is None
    assert (report.rows, report.kept, report.num_malformed) == (10, 4, 6)
    assert dict(report.malformed) == {
        "bad_json": 1,
        "missing_field": 2,
        "non_numeric_answer": 1,
        "not_an_object": 1,
        "bad_question": 1,
    }
    assert report.first_errors[0].startswith(f"{path}:2: bad_json")
    assert "6 malformed" in report.summary()


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "bad_json"),
        ('{"question": "no answer"}', "missing_field"),
        ('{"question": "Q?", "answer": "about seven"}', "non_numeric_answer"),
        ("[1, 2]", "not_an_object"),
    ],
)
def test_jsonl_strict_names_file_and_line(tmp_path, line, reason):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD[0]), "", line])
    cfg = DataConfig(task="gsm8k", path=path, strict=True)
    with pytest.raises(DataError, match=f"{path}:3: {reason}"):
        load_file_examples(cfg, path)


def test_custom_fields_and_glob(tmp_path):
    a = _write_jsonl(tmp_path / "part-0.jsonl", [json.dumps({"problem": "A", "solution": 1})])
    _write_jsonl(tmp_path / "part-1.jsonl", [json.dumps({"problem": "B", "solution": "#### 2"})])
    cfg = DataConfig(
        task="gsm8k", path=str(tmp_path / "part-*.jsonl"), question_field="problem",
        answer_field="solution",
    )  # fmt: skip
    examples, report = load_file_examples(cfg, cfg.path)
    assert [(e.prompt, e.answer, e.index) for e in examples] == [("A", "1", 0), ("B", "2", 1)]
    assert examples[0].source == f"{a}:1"
    # the default field names do not exist in these files: every row is missing a field
    cfg_default = DataConfig(task="gsm8k", path=a)
    with pytest.raises(DataError, match="no valid rows.*missing_field=1"):
        load_file_examples(cfg_default, a)


def test_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_file_examples(DataConfig(task="gsm8k", path="x"), str(tmp_path / "none.jsonl"))
    with pytest.raises(FileNotFoundError, match="glob matches no file"):
        load_file_examples(DataConfig(task="gsm8k", path="x"), str(tmp_path / "*.jsonl"))
    odd = tmp_path / "data.txt"
    odd.write_text(json.dumps(GOOD[0]) + "\n")
    with pytest.raises(DataError, match="file_format"):
        load_file_examples(DataConfig(task="gsm8k", path=str(odd)), str(odd))
    cfg = DataConfig(task="gsm8k", path=str(odd), file_format="jsonl")
    assert load_file_examples(cfg, str(odd))[1].kept == 1


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_parquet_rows_and_strict(tmp_path):
    rows = [
        {"q": "P1", "a": "#### 10"},
        {"q": "P2", "a": None},  # row 2: missing_field
        {"q": "P3", "a": "ten"},  # row 3: non_numeric_answer
        {"q": "P4", "a": "3,000"},
    ]
    path = _write_parquet(tmp_path / "train.parquet", rows)
    cfg = DataConfig(task="gsm8k", path=path, question_field="q", answer_field="a")
    examples, report = load_file_examples(cfg, path)
    assert [(e.prompt, e.answer) for e in examples] == [("P1", "10"), ("P4", "3000")]
    assert examples[1].source == f"{path}:row 4"
    assert dict(report.malformed) == {"missing_field": 1, "non_numeric_answer": 1}
    strict = DataConfig(task="gsm8k", path=path, question_field="q", answer_field="a", strict=True)
    with pytest.raises(DataError, match=f"{path}:row 2: missing_field"):
        load_file_examples(strict, path)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    path = _write_parquet(tmp_path / "t.parquet", [{"question": "Q", "answer": 1}])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(ImportError, match="needs pyarrow"):
        load_file_examples(DataConfig(task="gsm8k", path=path), path)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so she sold 72 clips.", "72", 1.0),
        ("so she sold 72.00 clips", "72", 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        (r"\boxed{1234} (not 7)", "1234", 1.0),
        ("#### 72\nI hope 5 is right", "72", 1.0),
        ("she lost -2.5 points", "-2.5", 1.0),
        ("she lost 2.5 points", "-2.5", 0.1),
        ("half: 0.333", "1/3", 0.1),
        (r"\boxed{\frac{1}{3}}", "1/3", 1.0),
        ("72 then 73", "72", 0.1),  # the last number counts
        ("no idea", "72", 0.0),
    ],
)
def test_gsm8k_reward_table(completion, answer, expected):
    assert gsm8k_reward(completion, answer, format_reward=0.1) == expected


def test_gsm8k_reward_rejects_non_numeric_gold():
    with pytest.raises(DataError, match="not a number"):
        gsm8k_reward("42", "forty-two")


def test_gsm8k_reward_survives_babbled_digits():
    assert gsm8k_reward("7" * 5000, "72") == 0.0
