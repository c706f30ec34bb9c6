"""Tests of the training-data loaders (llm2vec/dataset). CPU only, tiny files in tmp_path."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from llm2vec.dataset import (
    DataError,
    TrainDataset,
    TrainExample,
    arrange_global_batches,
    load_e5,
    load_jsonl,
)

# Table 6 of the paper, typed from the paper text (not taken from the module).
# file stem -> instruction(s)
PAPER_TABLE_6 = {
    "allnli": [
        "Given a premise, retrieve a hypothesis that is entailed by the premise",
        "Retrieve semantically similar text",
    ],
    "dureader": ["Given a Chinese search query, retrieve web passages that answer the question"],
    "eli5_question_answer": ["Provided a user question, retrieve the highest voted answers on Reddit ELI5 forum"],
    "fever": ["Given a claim, retrieve documents that support or refute the claim"],
    "hotpot_qa": ["Given a multi-hop question, retrieve documents that can help answer the question"],
    "miracl": ["Given a question, retrieve Wikipedia passages that answer the question"],
    "mrtydi": ["Given a question, retrieve Wikipedia passages that answer the question"],
    "msmarco_passage": ["Given a web search query, retrieve relevant passages that answer the query"],
    "msmarco_document": ["Given a web search query, retrieve relevant documents that answer the query"],
    "nq": ["Given a question, retrieve Wikipedia passages that answer the question"],
    "quora_duplicates": [
        "Given a question, retrieve questions that are semantically equivalent to the given question",
        "Find questions that have the same meaning as the input question",
    ],
    "squad": ["Retrieve Wikipedia passages that answer the question"],
    "t2ranking": ["Given a Chinese search query, retrieve web passages that answer the question"],
    "trivia_qa": ["Retrieve Wikipedia passages that answer the question"],
}


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def triples(prefix, n):
    return [{"query": f"{prefix} q{i}", "positive": f"{prefix} p{i}", "negative": f"{prefix} n{i}"} for i in range(n)]


def fake_echo_dir(tmp_path, n=8, skip=()):
    d = tmp_path / "echo-data"
    d.mkdir()
    for stem in PAPER_TABLE_6:
        if stem not in skip:
            write_jsonl(d / f"{stem}.jsonl", triples(stem, n))
    return d


def make_examples(sizes):
    return {
        src: [TrainExample(f"{src}-q{i}", f"{src}-p{i}", None, "", src) for i in range(n)] for src, n in sizes.items()
    }


def assert_single_source_blocks(items, size):
    assert len(items) % size == 0
    for start in range(0, len(items), size):
        block_sources = set()
        for example in items[start : start + size]:
            block_sources.add(example.source)
        assert len(block_sources) == 1, f"block at {start} mixes {block_sources}"


# ---------------------------------------------------------------- arrange_global_batches


def test_arrange_blocks_are_single_source_and_tails_dropped():
    sizes = {"a": 23, "b": 8, "c": 5, "d": 16}
    by_source = make_examples(sizes)
    out = arrange_global_batches(by_source, 4, seed=0)
    assert_single_source_blocks(out, 4)
    # each source contributes floor(n / 4) * 4 examples, the rest is dropped
    assert Counter(e.source for e in out) == {"a": 20, "b": 8, "c": 4, "d": 16}
    # every kept example appears exactly once, and comes from the input
    assert len(set(out)) == len(out)
    all_inputs = {e for v in by_source.values() for e in v}
    assert set(out) <= all_inputs


def test_arrange_deterministic_under_seed_and_changes_with_seed():
    by_source = make_examples({"a": 40, "b": 40, "c": 40})
    first = arrange_global_batches(by_source, 4, seed=1)
    again = arrange_global_batches(by_source, 4, seed=1)
    assert first == again
    # the input's dict order does not matter either
    reordered = {k: by_source[k] for k in ["c", "a", "b"]}
    assert arrange_global_batches(reordered, 4, seed=1) == first
    other = arrange_global_batches(by_source, 4, seed=2)
    assert other != first
    assert sorted(other, key=repr) == sorted(first, key=repr)


def test_arrange_shuffles_within_source_and_across_chunks():
    by_source = make_examples({"a": 64, "b": 64})
    out = arrange_global_batches(by_source, 8, seed=3)
    a_order = [e for e in out if e.source == "a"]
    assert a_order != by_source["a"]  # shuffled within the source
    block_sources = [out[i].source for i in range(0, len(out), 8)]
    assert block_sources != sorted(block_sources)  # sources interleaved, not a then b


def test_arrange_rejects_bad_batch_size():
    with pytest.raises(ValueError):
        arrange_global_batches(make_examples({"a": 4}), 0, seed=0)


def test_train_dataset_stats_and_summary():
    ds = TrainDataset.from_sources(make_examples({"a": 10, "b": 7}), 3, seed=0)
    assert len(ds) == 9 + 6
    assert isinstance(ds[0], TrainExample)
    assert ds.sources["a"].dropped_tail == 1 and ds.sources["a"].kept == 9
    assert ds.sources["b"].dropped_tail == 1 and ds.sources["b"].kept == 6
    summary = ds.summary()
    assert "a" in summary and "dropped_tail" in summary
    assert "5 global batches of 3" in summary


def test_train_dataset_too_small_is_an_error():
    with pytest.raises(DataError, match="global batch"):
        TrainDataset.from_sources(make_examples({"a": 3, "b": 2}), 4, seed=0)


# ---------------------------------------------------------------- E5 loader


def test_e5_instructions_match_table_6(tmp_path):
    d = fake_echo_dir(tmp_path, n=6)
    ds = load_e5(str(d), global_batch_size=2, seed=0, require_negative=True)
    assert len(ds) == 6 * len(PAPER_TABLE_6)
    assert set(ds.sources) == set(PAPER_TABLE_6)
    for ex in ds:
        assert ex.source in PAPER_TABLE_6
        assert ex.query_instruction in PAPER_TABLE_6[ex.source]
        # the texts are the file's texts, without instruction added
        assert ex.query.startswith(ex.source + " q")
        assert ex.positive.startswith(ex.source + " p")
        assert ex.negative.startswith(ex.source + " n")
    assert_single_source_blocks(list(ds), 2)


def test_e5_nli_and_quora_alternate_by_position(tmp_path):
    d = fake_echo_dir(tmp_path, n=6)
    ds = load_e5(str(d), global_batch_size=2, seed=0)
    seen = set()
    for ex in ds:
        if ex.source in ("allnli", "quora_duplicates"):
            position = int(ex.query.rsplit("q", 1)[1])
            expected = PAPER_TABLE_6[ex.source][position % 2]
            assert ex.query_instruction == expected, (ex.source, position)
            seen.add((ex.source, position % 2))
    assert seen == {("allnli", 0), ("allnli", 1), ("quora_duplicates", 0), ("quora_duplicates", 1)}


def test_e5_alternation_does_not_shift_when_a_record_is_skipped(tmp_path):
    d = fake_echo_dir(tmp_path, n=4)
    rows = triples("allnli", 4)
    rows[0]["query"] = "   "  # record 0 is skipped; record 1 must still get instruction 1
    write_jsonl(d / "allnli.jsonl", rows)
    ds = load_e5(str(d), global_batch_size=1, seed=0, sources=["allnli"])
    got = {ex.query: ex.query_instruction for ex in ds}
    assert got == {
        "allnli q1": PAPER_TABLE_6["allnli"][1],
        "allnli q2": PAPER_TABLE_6["allnli"][0],
        "allnli q3": PAPER_TABLE_6["allnli"][1],
    }


def test_e5_missing_files_listed_in_one_error(tmp_path):
    d = fake_echo_dir(tmp_path, skip=("fever", "nq", "t2ranking"))
    with pytest.raises(DataError) as err:
        load_e5(str(d), global_batch_size=2)
    message = str(err.value)
    for stem in ("fever", "nq", "t2ranking"):
        assert str(d / f"{stem}.jsonl") in message
    assert "squad.jsonl" not in message
    assert "echo-embeddings" in message
    # asking only for sources that are present works
    ds = load_e5(str(d), global_batch_size=2, sources=["squad"])
    assert set(ds.sources) == {"squad"}


def test_e5_missing_folder_lists_every_file(tmp_path):
    with pytest.raises(DataError) as err:
        load_e5(str(tmp_path / "nowhere"), global_batch_size=2)
    message = str(err.value)
    assert f"{len(PAPER_TABLE_6)} of {len(PAPER_TABLE_6)}" in message
    for stem in PAPER_TABLE_6:
        assert f"{stem}.jsonl" in message


def test_e5_unknown_source(tmp_path):
    d = fake_echo_dir(tmp_path)
    with pytest.raises(ValueError, match="unknown E5 source"):
        load_e5(str(d), global_batch_size=2, sources=["squad", "sqaud"])


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ('{"query": "q", "positive": ', "invalid JSON"),
        ('["q", "p", "n"]', "JSON object"),
        ('{"query": "q", "negative": "n"}', '"positive" is missing'),
        ('{"query": "q", "positive": 3, "negative": "n"}', '"positive" must be a string'),
        ('{"query": "q", "positive": "p"}', '"negative" is missing'),
    ],
)
def test_e5_malformed_line_names_file_and_line(tmp_path, bad_line, problem):
    d = fake_echo_dir(tmp_path, n=4)
    rows = triples("squad", 4)
    rows.insert(2, bad_line)  # line 3
    write_jsonl(d / "squad.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_e5(str(d), global_batch_size=2)
    message = str(err.value)
    assert f"{d / 'squad.jsonl'}:3:" in message
    assert problem in message


def test_e5_empty_texts_skipped_and_counted(tmp_path, caplog):
    d = fake_echo_dir(tmp_path, n=6)
    rows = triples("fever", 6)
    rows[1]["query"] = ""
    rows[3]["positive"] = " \n\t "
    rows[4]["negative"] = "  "
    write_jsonl(d / "fever.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="llm2vec.dataset"):
        ds = load_e5(str(d), global_batch_size=1, sources=["fever"])
    assert sorted(e.query for e in ds) == ["fever q0", "fever q2", "fever q5"]
    assert ds.sources["fever"].skipped_empty == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert any("fever.jsonl" in m and "skipped 3" in m for m in warnings), warnings
    assert "3" in ds.summary()


def test_e5_negative_optional_for_stage_one(tmp_path):
    d = fake_echo_dir(tmp_path, n=4)
    rows = triples("nq", 4)
    del rows[0]["negative"]
    rows[1]["negative"] = "   "
    write_jsonl(d / "nq.jsonl", rows)
    ds = load_e5(str(d), global_batch_size=1, sources=["nq"], require_negative=False)
    negatives = {e.query: e.negative for e in ds}
    assert negatives == {"nq q0": None, "nq q1": None, "nq q2": "nq n2", "nq q3": "nq n3"}
    with pytest.raises(DataError, match="nq.jsonl:1:"):
        load_e5(str(d), global_batch_size=1, sources=["nq"], require_negative=True)


def test_e5_file_with_only_empty_records_is_an_error(tmp_path):
    d = fake_echo_dir(tmp_path, n=4)
    write_jsonl(d / "miracl.jsonl", [{"query": " ", "positive": "p", "negative": "n"}] * 3)
    with pytest.raises(DataError, match="miracl.jsonl"):
        load_e5(str(d), global_batch_size=2)


def test_e5_strips_whitespace_and_max_per_source(tmp_path):
    d = fake_echo_dir(tmp_path, n=10)
    write_jsonl(
        d / "squad.jsonl",
        [{"query": "  padded q \n", "positive": "\tpadded p ", "negative": " padded n"}] + triples("squad", 9),
    )
    ds = load_e5(str(d), global_batch_size=1, sources=["squad"], max_per_source=3)
    assert len(ds) == 3
    padded = TrainExample("padded q", "padded p", "padded n", PAPER_TABLE_6["squad"][0], "squad")
    assert padded in list(ds)


# ---------------------------------------------------------------- user JSONL loader


def test_jsonl_instructions_source_and_optional_negative(tmp_path):
    a = write_jsonl(
        tmp_path / "fiqa.jsonl",
        [
            {"query": "q0", "positive": "p0", "instruction": " Find financial answers "},
            {"query": "q1", "positive": "p1", "negative": "n1"},
            {"query": "q2", "positive": "p2", "instruction": ""},
            {"query": "q3", "positive": "p3", "negative": None},
        ],
    )
    b = write_jsonl(tmp_path / "pairs.jsonl", [{"query": f"b{i}", "positive": f"bp{i}"} for i in range(4)])
    ds = load_jsonl([str(a), str(b)], global_batch_size=2, seed=0, default_instruction="Default task")
    by_query = {e.query: e for e in ds}
    assert by_query["q0"].query_instruction == "Find financial answers"
    assert by_query["q1"].query_instruction == "Default task"
    assert by_query["q2"].query_instruction == ""  # an explicit empty instruction is kept
    assert by_query["q1"].negative == "n1"
    assert by_query["q0"].negative is None and by_query["q3"].negative is None
    assert {e.source for e in ds} == {"fiqa", "pairs"}
    assert by_query["b0"].source == "pairs" and by_query["q0"].source == "fiqa"
    assert_single_source_blocks(list(ds), 2)


def test_jsonl_single_path_and_default_empty_instruction(tmp_path):
    a = write_jsonl(tmp_path / "mine.jsonl", [{"query": "q", "positive": "p"}])
    ds = load_jsonl(str(a), global_batch_size=1)
    assert list(ds) == [TrainExample("q", "p", None, "", "mine")]


def test_jsonl_require_negative_and_bad_instruction(tmp_path):
    a = write_jsonl(tmp_path / "x.jsonl", [{"query": "q", "positive": "p"}])
    with pytest.raises(DataError, match=r"x\.jsonl:1:.*negative"):
        load_jsonl(str(a), global_batch_size=1, require_negative=True)
    b = write_jsonl(tmp_path / "y.jsonl", [{"query": "q", "positive": "p", "instruction": 5}])
    with pytest.raises(DataError, match=r"y\.jsonl:1:.*instruction"):
        load_jsonl(str(b), global_batch_size=1)


def test_jsonl_missing_files_and_duplicate_stems(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"query": "q", "positive": "p"}])
    with pytest.raises(DataError) as err:
        load_jsonl([str(a), str(tmp_path / "b.jsonl"), str(tmp_path / "c.jsonl")], 1)
    assert "b.jsonl" in str(err.value) and "c.jsonl" in str(err.value)
    (tmp_path / "d").mkdir()
    a2 = write_jsonl(tmp_path / "d" / "a.jsonl", [{"query": "q", "positive": "p"}])
    with pytest.raises(ValueError, match="same stem"):
        load_jsonl([str(a), str(a2)], 1)


def test_jsonl_blank_lines_ignored_and_counted(tmp_path):
    rows = [{"query": "q0", "positive": "p0"}, "", "  ", {"query": "q1", "positive": "p1"}]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    ds = load_jsonl(str(a), global_batch_size=1)
    assert sorted(e.query for e in ds) == ["q0", "q1"]
    assert ds.sources["a"].blank_lines == 2


def test_duplicate_pairs_and_negatives_equal_to_their_positive_are_counted_and_warned(tmp_path, caplog):
    """Both are kept (the data is the user's), but a repeated pair puts the same positive twice in a batch (each
    copy an in-batch negative of the other query) and a negative equal to its positive scores exactly as it."""
    rows = triples("fiqa", 8)
    rows[4] = {**rows[1], "negative": "another negative"}  # line 5 repeats the pair of line 2
    rows[6] = dict(rows[1])  # line 7 too
    rows[2]["negative"] = " " + rows[2]["positive"]  # line 3: the same text once stripped
    path = write_jsonl(tmp_path / "fiqa.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="llm2vec.dataset"):
        ds = load_jsonl(str(path), global_batch_size=1, require_negative=True)
    assert len(ds) == 8  # nothing dropped
    warnings = " | ".join(r.getMessage() for r in caplog.records)
    assert f"{path}: 2 of 8 records repeat the query and positive of an earlier record (lines 5, 7)" in warnings
    assert f"{path}: 1 of 8 records has a negative equal to its positive (line 3)" in warnings

    caplog.clear()
    clean = write_jsonl(tmp_path / "clean.jsonl", triples("clean", 8))
    with caplog.at_level(logging.WARNING, logger="llm2vec.dataset"):
        load_jsonl(str(clean), global_batch_size=1, require_negative=True)
    assert not caplog.records


def test_a_data_line_longer_than_the_limit_is_refused_with_its_line_number(tmp_path, monkeypatch):
    """The limit is lowered for the test (``llm2vec.io.MAX_LINE_BYTES``); a line of exactly the limit, its newline
    included, is read."""
    import llm2vec.io

    monkeypatch.setattr(llm2vec.io, "MAX_LINE_BYTES", 200)
    rows = triples("fiqa", 4)
    fits = {"query": "q", "positive": "p", "negative": ""}
    fits["negative"] = "n" * (199 - len(json.dumps(fits)))  # 199 characters and the newline: 200 bytes
    rows[1] = fits
    path = write_jsonl(tmp_path / "fiqa.jsonl", rows)
    assert len(load_jsonl(str(path), global_batch_size=1)) == 4
    rows[2] = {**fits, "negative": fits["negative"] + "n"}
    path = write_jsonl(tmp_path / "fiqa.jsonl", rows)
    with pytest.raises(DataError, match=f"^{path}:3: the line is longer than 200 bytes"):
        load_jsonl(str(path), global_batch_size=1)


def test_a_huge_data_line_is_refused_in_bounded_memory(tmp_path, monkeypatch):
    """A 4 MiB line under a 64 KiB limit: the reader never holds more than about the limit (Python's allocations,
    traced), where reading the line whole would take 4 MiB and more."""
    import tracemalloc

    import llm2vec.io

    monkeypatch.setattr(llm2vec.io, "MAX_LINE_BYTES", 64 * 1024)
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"query": "q", "positive": "p"}) + "\n")
        f.write(json.dumps({"query": "q", "positive": "p" * (4 << 20)}) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=f"^{path}:2: the line is longer than 65,536 bytes"):
            load_jsonl(str(path), global_batch_size=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
