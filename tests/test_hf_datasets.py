"""The Hugging Face loader (``dataset_name: hf``, llm2vec/dataset/hf.py): the same examples and global batches as
the JSON-lines loader on the same rows, whatever the storage; column mapping; several datasets as several
sources; bad rows named by dataset, row and field; a cached dataset id read offline; memory bounded by the
memory-mapped tables. CPU only, data written in tmp_path, nothing downloaded."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm2vec.arguments import ConfigError, DataArguments, parse_config
from llm2vec.dataset import ArrowTrainDataset, DataError, TrainExample, load_hf, load_jsonl

ROOT = Path(__file__).resolve().parents[1]
TEXT_COLUMNS = ("query", "positive", "negative", "instruction")


@pytest.fixture(autouse=True)
def quiet_datasets():
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


# ---------------------------------------------------------------------------------------------- writing rows


def edge_rows(prefix: str, n: int) -> list[dict]:
    """Rows with what the JSON-lines rules treat specially: absent, null and empty negatives and instructions,
    surrounding whitespace of every kind Python strips, and a query that is whitespace only (skipped)."""
    rows = []
    for i in range(n):
        row = {"query": f"{prefix} query {i}", "positive": f"{prefix} positive {i}"}
        if i % 3:
            row["negative"] = f"{prefix} negative {i}"
        if i % 4 == 0:
            row["instruction"] = f" instruction {i % 8} "
        if i % 10 == 5:
            row["instruction"] = ""  # explicitly none
        if i % 10 == 7:
            row["negative"] = None
        rows.append(row)
    rows[2]["query"] = "\u3000\x1c \t\u2029"  # whitespace only by str.strip(): skipped
    rows[3]["positive"] = "\u2003 padded text\x85 "
    rows[6]["negative"] = "  "  # an empty negative: none
    return rows


def write_jsonl(path: Path, rows: list, blank_after: int | None = None) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
            if i == blank_after:
                f.write("\n")
    return path


def as_table(rows: list[dict], columns=TEXT_COLUMNS) -> pa.Table:
    """The rows as a table of string columns; a key a row lacks is null, as the JSON-lines loader reads it."""
    return pa.table({c: pa.array([r.get(c) for r in rows], pa.string()) for c in columns})


def write(kind: str, folder: Path, name: str, rows: list[dict], columns=TEXT_COLUMNS) -> Path:
    """``rows`` stored as ``kind``: a save_to_disk folder, a parquet, JSON-lines or ``.arrow`` file, the last as the
    Arrow stream ``datasets`` writes (``arrow``) or in Arrow's random-access file format (``arrow_file``, as
    ``pyarrow.ipc.new_file`` and feather write it)."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        return write_jsonl(folder / f"{name}.jsonl", rows)
    table = as_table(rows, columns)
    if kind == "parquet":
        pq.write_table(table, folder / f"{name}.parquet")
        return folder / f"{name}.parquet"
    if kind in ("arrow", "arrow_file"):
        new = pa.ipc.new_stream if kind == "arrow" else pa.ipc.new_file
        with pa.OSFile(str(folder / f"{name}.arrow"), "wb") as sink, new(sink, table.schema) as w:
            w.write_table(table)
        return folder / f"{name}.arrow"
    assert kind == "folder"
    datasets.Dataset(table).save_to_disk(str(folder / name))
    return folder / name


def assert_single_source_blocks(items, size):
    assert len(items) % size == 0
    for start in range(0, len(items), size):
        assert len({e.source for e in items[start : start + size]}) == 1, f"block at {start} mixes sources"


KINDS = ("folder", "parquet", "jsonl", "arrow", "arrow_file")


# ---------------------------------------------------------------------------------------------- the same examples


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("require_negative", [False, True])
def test_every_storage_gives_the_jsonl_loaders_examples_and_global_batches(tmp_path, kind, require_negative):
    """The same rows as a save_to_disk folder, a parquet, JSON-lines or Arrow file give, for a fixed seed, exactly
    the JSON-lines loader's arranged examples (so its global batches), held-out pairs, counts and summary."""
    rows = {"fiqa": edge_rows("fiqa", 41), "nfcorpus": edge_rows("nf", 30)}
    if require_negative:  # a required negative is never null; an empty one skips its row
        rows = {n: [{**r, "negative": r.get("negative") or ""} for r in source] for n, source in rows.items()}
    (tmp_path / "ref").mkdir()
    reference_files = [write_jsonl(tmp_path / "ref" / f"{n}.jsonl", r) for n, r in rows.items()]
    paths = [write(kind, tmp_path / kind, n, r) for n, r in rows.items()]
    options = dict(seed=11, default_instruction=" Retrieve it ", require_negative=require_negative, validation_size=5)
    reference = load_jsonl(reference_files, 4, **options)
    got = load_hf(paths, 4, cache_dir=str(tmp_path / "cache"), **options)

    assert isinstance(got, ArrowTrainDataset) and len(got) == len(reference) == got.num_global_batches * 4
    assert list(got) == list(reference.examples)  # the arranged order: every global batch the same
    assert list(got.examples) == reference.examples and got.examples[-3:] == reference.examples[-3:]
    assert got.held_out == reference.held_out
    assert got.summary() == reference.summary()
    assert_single_source_blocks(list(got), 4)
    # an example says where it came from: the dataset and its row
    for example in got.examples[:8]:
        source_rows = rows[example.source]
        path, _, row = example.origin.rpartition(", row ")
        assert path == str(paths[sorted(rows).index(example.source)])
        assert source_rows[int(row)]["query"].strip() == example.query


def test_instruction_examples_cover_every_distinct_instruction_from_the_first_example(tmp_path):
    """What the driver runs through the collator before step 1: the first training example, then one example of
    each other instruction trained with, as the list-backed dataset gives."""
    rows = edge_rows("a", 64)
    reference = load_jsonl([write_jsonl(tmp_path / "a.jsonl", rows)], 8, seed=3, default_instruction="D")
    got = load_hf([write("parquet", tmp_path / "p", "a", rows)], 8, seed=3, default_instruction="D")
    checked = got.instruction_examples()
    assert checked[0] == got[0] == reference.instruction_examples()[0]
    assert {e.query_instruction for e in checked} == {e.query_instruction for e in reference.instruction_examples()}
    assert len(checked) == len({e.query_instruction for e in checked})


def test_text_is_stripped_and_emptiness_judged_as_python_strips(tmp_path):
    """The loader strips texts and judges them empty with pyarrow, by the characters ``str.strip`` removes: exactly
    those (every character to U+3100, past the last one Python strips, through the loader; all of them in pyarrow)."""
    import pyarrow.compute as pc

    every = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000]  # surrogates are no text
    padded = [f"{c}a{c}" for c in every]
    assert pc.utf8_trim_whitespace(pa.array(padded)).to_pylist() == [text.strip() for text in padded]
    rows = [{"query": c * 2, "positive": f"{c}p{c}"} for c in every[:0x3100]]
    ds = load_hf([write("parquet", tmp_path, "ws", rows, ("query", "positive"))], 1, cache_dir=str(tmp_path / "c"))
    read = {int(e.origin.rpartition(" ")[2]): (e.query, e.positive) for e in ds}
    assert sorted(read) == [i for i, row in enumerate(rows) if row["query"].strip()]
    assert all(read[i] == (rows[i]["query"].strip(), rows[i]["positive"].strip()) for i in read)


def test_items_index_like_a_list_and_pickle_without_the_table(tmp_path):
    """A data-loader worker may receive the dataset pickled: the memory-mapped table travels as its file."""
    import pickle

    ds = load_hf([write("folder", tmp_path, "a", edge_rows("a", 2000))], 4, seed=0)
    assert ds[-1] == ds[len(ds) - 1] and ds.examples[-1] == ds[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    ds[0]  # the columns read are cached, and left out of the pickle
    data = pickle.dumps(ds)
    assert list(pickle.loads(data)) == list(ds)
    assert len(data) < sum(len(e.query) + len(e.positive) for e in ds)  # the rows' integers, not their texts


# ---------------------------------------------------------------------------------------------- columns


def st_rows(n: int) -> list[dict]:
    return [{"anchor": f"question {i}", "positive": f"answer {i}", "negative": f"other {i}"} for i in range(n)]


def test_sentence_transformers_columns_are_read_by_name(tmp_path):
    """anchor / positive / negative (sentence-transformers' triplets) need no mapping: anchor is the query."""
    path = write("parquet", tmp_path, "triplets", st_rows(12), columns=("anchor", "positive", "negative"))
    same = [{"query": r["anchor"], "positive": r["positive"], "negative": r["negative"]} for r in st_rows(12)]
    reference = load_jsonl([write_jsonl(tmp_path / "triplets.jsonl", same)], 4, seed=1, require_negative=True)
    got = load_hf([path], 4, seed=1, require_negative=True)
    assert list(got) == reference.examples


def test_column_map_renames_for_every_source_and_per_source(tmp_path):
    qa = [{"question": f"q{i}", "answer": f"a{i}", "id": str(i), "task": f"Find {i % 2}"} for i in range(8)]
    a = write("parquet", tmp_path, "a", qa, columns=("question", "answer", "id", "task"))
    b = write(
        "folder", tmp_path, "b", [{**r, "question": "b " + r["question"]} for r in qa], ("question", "answer", "id")
    )
    column_map = {"query": "question", "positive": "answer", "a": {"instruction": "task"}}
    ds = load_hf([a, b], 2, seed=0, column_map=column_map, default_instruction="none given")
    by_source = {(e.source, e.query): e for e in ds}
    assert by_source[("a", "q3")] == TrainExample("q3", "a3", None, "Find 1", "a")
    assert by_source[("b", "b q3")] == TrainExample("b q3", "a3", None, "none given", "b")


def test_a_column_of_nulls_only_means_no_negative_and_no_instruction(tmp_path):
    """A DataFrame's all-None column is stored with Arrow's null type: no row has that field (a required negative
    is then missing in the first row)."""
    table = pa.table(
        {"anchor": ["a", "b"], "positive": ["c", "d"], "negative": pa.nulls(2), "instruction": pa.nulls(2)}
    )
    pq.write_table(table, tmp_path / "nulls.parquet")
    ds = load_hf([tmp_path / "nulls.parquet"], 1, default_instruction="D", cache_dir=str(tmp_path / "cache"))
    assert sorted(ds, key=lambda e: e.query) == [
        TrainExample("a", "c", None, "D", "nulls"),
        TrainExample("b", "d", None, "D", "nulls"),
    ]
    assert [e.query_instruction for e in ds.instruction_examples()] == ["D"]
    with pytest.raises(DataError, match=r'nulls.parquet, row 0: required field "negative" is missing or null'):
        load_hf([tmp_path / "nulls.parquet"], 1, require_negative=True, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "columns, column_map, message",
    [
        (
            ("question", "answer"),
            {"query": "questoin", "positive": "answer"},
            'column_map maps "query" to "questoin", which is not a column; its columns are: question, answer',
        ),
        (
            ("question", "answer"),
            None,
            'no column for field "query": looked for "query" or "anchor"; its columns are: question, answer; map one '
            'with column_map, e.g. {"query": "<column>"}',
        ),
        (("query", "anchor", "positive"), None, 'both query and anchor could be the "query" column'),
        (
            ("query", "positive"),
            {"other": {"query": "query"}},
            "column_map: 'other' names no source; the sources are: d",
        ),
    ],
)
def test_unknown_or_missing_columns_are_refused_with_the_columns_listed(tmp_path, columns, column_map, message):
    rows = [{c: f"{c} {i}" for c in columns} for i in range(4)]
    path = write("parquet", tmp_path, "d", rows, columns=columns)
    with pytest.raises(DataError) as error:
        load_hf([path], 2, column_map=column_map)
    assert message in str(error.value)


def test_a_required_negative_column_missing_is_refused(tmp_path):
    path = write("parquet", tmp_path, "d", st_rows(4), columns=("anchor", "positive"))
    load_hf([path], 2)  # Stage I: pairs are enough
    with pytest.raises(DataError, match='no column for field "negative" .*require_negative.*its columns are: anchor, '):
        load_hf([path], 2, require_negative=True)


def test_a_bad_column_map_is_a_config_error():
    with pytest.raises(ConfigError, match="'querry' is not a role"):
        DataArguments(dataset_name="hf", column_map={"querry": "q"})
    with pytest.raises(ConfigError, match="give a column name"):
        DataArguments(dataset_name="hf", column_map={"s": {"query": 3}})
    with pytest.raises(ConfigError, match="column_map is for dataset_name hf"):
        DataArguments(dataset_name="jsonl", column_map={"query": "q"})


# ---------------------------------------------------------------------------------------------- several sources


def test_several_datasets_are_several_sources_each_global_batch_from_one(tmp_path):
    """A folder, a parquet file and a JSON-lines file: three sources, as the E5 mix's files are."""
    paths = [
        write("folder", tmp_path, "nli", edge_rows("nli", 40)),
        write("parquet", tmp_path, "nq", edge_rows("nq", 33)),
        write("jsonl", tmp_path, "squad", edge_rows("squad", 26)),
    ]
    ds = load_hf(",".join(map(str, paths)), 4, seed=5)
    assert set(ds.sources) == {"nli", "nq", "squad"}
    examples = list(ds)
    assert_single_source_blocks(examples, 4)
    assert {e.source for e in examples} == {"nli", "nq", "squad"}
    assert [ds.sources[n].kept for n in ("nli", "nq", "squad")] == [36, 32, 24]  # one whitespace-only query each
    blocks = [examples[i].source for i in range(0, len(examples), 4)]
    assert blocks != sorted(blocks)  # the sources' batches are interleaved
    with pytest.raises(DataError, match="have the same name 'nq'"):
        load_hf([paths[1], write("jsonl", tmp_path / "x", "nq", edge_rows("x", 8))], 4)


def test_max_examples_per_source_keeps_the_first_rows_that_pass_the_checks(tmp_path):
    """As the E5 loader's limit: the first rows that are kept, the rows read up to the last of them counted."""
    path = write("parquet", tmp_path, "nq", edge_rows("nq", 30))  # row 2's query is whitespace only
    ds = load_hf([path], 1, max_per_source=10)
    assert sorted(int(e.origin.rpartition(" ")[2]) for e in ds) == [0, 1, *range(3, 11)]
    assert (ds.sources["nq"].records, ds.sources["nq"].skipped_empty, ds.sources["nq"].kept) == (11, 1, 10)


# ---------------------------------------------------------------------------------------------- bad rows


def test_null_and_missing_required_texts_name_dataset_row_and_field(tmp_path):
    rows = st_rows(6)
    rows[4]["anchor"] = None
    path = write("parquet", tmp_path, "d", rows, columns=("anchor", "positive", "negative"))
    with pytest.raises(DataError) as error:
        load_hf([path], 2)
    assert (
        str(error.value)
        == f'{path}, row 4: required field "query" (column "anchor") is missing or null. Fix or remove this row.'
    )
    lines = [{"query": f"q{i}", "positive": f"p{i}"} for i in range(5)]
    del lines[3]["positive"]
    path = write_jsonl(tmp_path / "gap.jsonl", lines, blank_after=0)  # a blank line: row 3 is line 5
    with pytest.raises(DataError, match=rf'^{path}, row 3 \(line 5\): required field "positive" is missing or null'):
        load_hf([path], 2, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ['{"query": "a", "positive": "b"}', '{"query": 3, "positive": "d"}'],
            ', row 1 (line 2): field "query" must be a string, got JSON 3',
        ),
        (
            ['{"query": "a", "positive": "b"}', '{"query": "c", "positive": ["d"]}'],
            ', row 1 (line 2): field "positive" must be a string, got JSON ["d"]',
        ),
        (
            ['{"query": 1, "positive": "b"}', '{"query": 3, "positive": "d"}'],
            ', row 0 (line 1): field "query" must be a string, got JSON 1',
        ),
        (['{"query": "a", "positive": "b"}', '{"query": "a",'], ":2: invalid JSON"),
        (['{"query": "a", "positive": "b"}', "[1, 2]"], ":2: expected a JSON object, got list"),
        (
            ['{"query": "a", "positive": "b"}', '{"query": "a \\ud800", "positive": "b"}'],
            ':2: field "query" holds half of a UTF-16 surrogate pair',
        ),
    ],
)
def test_bad_json_lines_name_the_line_and_field(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as error:
        load_hf([path], 1, cache_dir=str(tmp_path / "cache"))
    assert str(error.value).startswith(str(path)) and message in str(error.value), str(error.value)


def test_a_json_file_holding_one_array_is_refused_naming_the_json_lines_form(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('  [{"query": "a", "positive": "b"}]')
    with pytest.raises(DataError, match=r"rows.json: a JSON array; a .json or .jsonl file is read as JSON lines"):
        load_hf([path], 1, cache_dir=str(tmp_path / "cache"))


def test_a_column_that_is_not_text_or_not_utf8_names_row_and_field(tmp_path):
    table = pa.table({"query": pa.array([None, 7, 8], pa.int64()), "positive": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "ints.parquet")
    with pytest.raises(DataError, match=r'ints.parquet, row 1: field "query" must be a string, got int64 \(7\)'):
        load_hf([tmp_path / "ints.parquet"], 1, cache_dir=str(tmp_path / "cache"))
    broken = pa.array([b"fine", b"caf\xe9", b"x"], pa.binary()).view(pa.string())  # Latin-1 bytes in a string
    table = pa.table({"query": ["a", "b", "c"], "positive": broken})
    with pa.OSFile(str(tmp_path / "latin.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r'latin.arrow, row 1: field "positive" is not valid UTF-8'):
        load_hf([tmp_path / "latin.arrow"], 1)


def test_empty_texts_are_skipped_counted_and_the_first_named(tmp_path, caplog):
    rows = st_rows(8)
    rows[5]["positive"] = " \n"
    rows[6]["negative"] = ""
    path = write("folder", tmp_path, "d", rows, columns=("anchor", "positive", "negative"))
    with caplog.at_level(logging.WARNING, logger="llm2vec.dataset.hf"):
        ds = load_hf([path], 2, require_negative=True)
    assert ds.sources["d"].skipped_empty == 2 and ds.sources["d"].records == 8
    assert (
        f"{path}: skipped 2 of 8 rows whose query, positive or negative is empty or whitespace only (the first: "
        in caplog.text
    )
    assert 'row 5, field "positive")' in caplog.text
    empty = write("parquet", tmp_path, "e", [{"anchor": " ", "positive": "p"}] * 3, columns=("anchor", "positive"))
    with pytest.raises(DataError, match="all 3 rows were skipped because a required text is empty"):
        load_hf([empty], 1)


def test_missing_paths_and_unread_ids_are_named(tmp_path):
    with pytest.raises(DataError, match=r"2 of 3 datasets not found:\n  - .*nope.parquet\n  - .*gone/"):
        load_hf([write("jsonl", tmp_path, "a", st_rows(2)), tmp_path / "nope.parquet", f"{tmp_path}/gone/"], 1)
    with pytest.raises(DataError, match="is a folder but not one written by save_to_disk"):
        load_hf([tmp_path], 1)
    with pytest.raises(
        DataError, match="dataset nobody/nothing: no local file or folder of that name, and not readable"
    ):
        load_hf(["nobody/nothing"], 1, cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------- a cached dataset id


def cache_as_hub_dataset(cache: Path, repo: str, config: str, rows: list[dict]) -> None:
    """Put ``rows`` in ``cache`` where ``datasets.load_dataset(repo, config)`` left a hub dataset it downloaded
    (``<owner>___<name>/<config>/<version>/<hash>/``), as a parquet-backed hub dataset is prepared."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo.split("/")
    source = cache / "source.parquet"
    cache.mkdir(parents=True, exist_ok=True)
    pq.write_table(as_table(rows, ("anchor", "positive", "negative")), source)
    builder = Parquet(
        cache_dir=str(cache),
        dataset_name=name,
        config_name=config,
        config_id=config,
        data_files={"train": str(source)},
        hash="0123abcd",
    )
    builder.download_and_prepare()
    os.rename(cache / name, cache / f"{owner}___{name}")


def test_a_dataset_id_in_the_local_cache_is_read_offline(tmp_path):
    rows = st_rows(10)
    cache_as_hub_dataset(tmp_path / "cache", "someone/tiny-triplets", "triplet", rows)
    got = load_hf(
        ["someone/tiny-triplets:triplet"], 2, seed=4, cache_dir=str(tmp_path / "cache"), require_negative=True
    )
    folder = write(
        "folder", tmp_path, "someone/tiny-triplets:triplet".replace("/", "_"), rows, ("anchor", "positive", "negative")
    )
    reference = load_hf([folder], 2, seed=4, require_negative=True)
    assert [(e.query, e.positive, e.negative) for e in got] == [(e.query, e.positive, e.negative) for e in reference]
    assert set(got.sources) == {"someone/tiny-triplets:triplet"}
    assert got.sources["someone/tiny-triplets:triplet"].files[0].endswith("-train.arrow")
    with pytest.raises(DataError, match="no split 'test'|Unknown split"):
        load_hf(["someone/tiny-triplets:triplet"], 2, split="test", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="Couldn't find cache for someone/tiny-triplets for config 'pair'"):
        load_hf(["someone/tiny-triplets:pair"], 2, cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------- the driver


def test_the_driver_reads_hf_data_with_its_column_map_from_the_command_line(tmp_path):
    from llm2vec.training import load_training_data

    path = write(
        "parquet", tmp_path, "qa", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(6)], ("question", "answer")
    )
    argv = ["--model_name_or_path", "m", "--output_dir", str(tmp_path / "o"), "--dataset_name", "hf"]
    argv += ["--dataset_file_path", str(path), "--column_map", '{"query": "question", "positive": "answer"}']
    config = parse_config("I", argv)
    assert config.data.column_map == {"query": "question", "positive": "answer"}
    dataset = load_training_data(config.data, global_batch_size=2, seed=0, require_negative=False)
    assert sorted(e.query for e in dataset) == [f"q{i}" for i in range(6)]


def test_an_instruction_tokenization_rejects_is_found_while_loading(tmp_path, monkeypatch, capsys):
    """As for JSON-lines files (tests/test_hostile_input.py): a row whose instruction leaves no room for text stops the
    run before the weights load, naming the dataset and row."""
    from llm2vec import training
    from llm2vec.testing import save_tiny_model

    rows = [{"query": f"the quick fox {i}", "positive": f"jumps over the dog {i}"} for i in range(8)]
    rows[5]["instruction"] = " ".join(["retrieve passages"] * 40)
    path = write("parquet", tmp_path, "mine", rows, ("query", "positive", "instruction"))

    def no_model(stage):
        raise AssertionError("the weights were loaded before the data was checked")

    monkeypatch.setattr(training, "model_class", no_model)
    argv = [
        "--model_name_or_path",
        str(save_tiny_model("llama3", tmp_path / "model")),
        "--output_dir",
        str(tmp_path / "run"),
    ]
    argv += ["--dataset_name", "hf", "--dataset_file_path", str(path), "--max_seq_length", "32", "--use_cpu", "true"]
    argv += ["--per_device_train_batch_size", "4", "--max_steps", "1"]
    assert training.main("I", argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and f"{path}, row 5: " in err[0] and "leaves no room for text" in err[0], err


def test_a_run_trains_on_hf_data_and_records_its_files(tmp_path):
    """Stage I, two steps on a save_to_disk folder and a parquet file: the trainer reads the dataset in its order,
    run_config.json fingerprints the files behind each source, and the instructions trained with read back from it
    (an export's query prompt)."""
    from llm2vec import training
    from llm2vec.provenance import trained_query_instructions
    from llm2vec.testing import save_tiny_model

    folder = write("folder", tmp_path, "nli", st_rows(16), ("anchor", "positive", "negative"))
    parquet = write("parquet", tmp_path, "nq", edge_rows("nq", 12))
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(save_tiny_model("llama3", tmp_path / "model")), "--output_dir", str(out)]
    argv += ["--dataset_name", "hf", "--dataset_file_path", f"{folder},{parquet}", "--max_seq_length", "32"]
    argv += ["--use_cpu", "true", "--per_device_train_batch_size", "4", "--max_steps", "2", "--warmup_steps", "0"]
    argv += ["--num_threads", "1", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]
    trainer = training.run("I", argv + ["--default_instruction", "Find it"])
    assert trainer.state.global_step == 2
    run_config = json.loads((out / "run_config.json").read_text())
    recorded = run_config["inputs"]["data"]
    assert str(parquet) in recorded and any(p.startswith(str(folder)) and p.endswith(".arrow") for p in recorded)
    # what an export reads back for its query prompt: every row's instruction, as the loader gives it
    expected = Counter(
        r.get("instruction").strip() if r.get("instruction") is not None else "Find it" for r in edge_rows("nq", 12)
    )
    expected["Find it"] += 16
    trained = {e.query_instruction for e in trainer.train_dataset}  # the dropped tail aside
    assert set(trained_query_instructions(run_config)) == trained < set(expected)  # the record: what trained
    del run_config["inputs"]["query_instructions"]  # a run without the record: the data read back, as it trained
    assert trained_query_instructions(run_config) == expected


# ---------------------------------------------------------------------------------------------- memory


def test_memory_stays_far_below_a_list_of_python_objects(tmp_path):
    """200,000 pairs, each loader in a fresh process (experiments/research/benchmark_data.py): the memory the process owns
    (the mapped pages of the table aside, which the kernel can drop) grows by a small fraction of what the
    JSON-lines loader's Python objects take, and all variants give the same arranged examples."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "research" / "benchmark_data.py"), "--rows", "200000", "--json"]
        + ["--passage_words", "5", "15", "--work", str(tmp_path / "work"), "--only", "jsonl", "hf_disk"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["variant"]: r for r in map(json.loads, result.stdout.splitlines())}
    own = {v: r["peak_anon_mib"] - r["setup_anon_mib"] for v, r in records.items()}
    resident = {v: r["peak_rss_mib"] - r["setup_rss_mib"] for v, r in records.items()}
    assert own["jsonl"] > 50, records  # the Python objects of 200,000 pairs (140 MiB measured)
    assert own["hf_disk"] < own["jsonl"] / 4, own  # 12 MiB measured
    assert resident["hf_disk"] < resident["jsonl"], resident  # the mapped pages counted too
    assert len({(r["examples"], r["digest"]) for r in records.values()}) == 1


# ---------------------------------------------------------------------------------------------- only named inputs


@pytest.mark.parametrize("builder", ["text", "json", "parquet", "csv", "JSON"])
def test_a_builder_name_is_refused_not_run_over_the_working_folder(tmp_path, monkeypatch, builder):
    """``datasets.load_dataset("text")`` reads every matching file under the working folder, recursively: a name of a
    datasets builder is no dataset the user named, and is refused in one line before anything is read."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.txt").write_text("private\n")
    write_jsonl(tmp_path / "sub" / "other.jsonl", st_rows(2))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as refused:
        load_hf(builder, 1, column_map={"query": "text", "positive": "text"}, cache_dir=str(tmp_path / "cache"))
    message = str(refused.value)
    assert "\n" not in message and f"dataset_file_path {builder!r}: the name of a datasets builder" in message
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_file_rewritten_with_its_old_time_is_converted_again(tmp_path, kind):
    """``datasets`` keys its conversion cache by the file's path and modification time: a file rewritten with other
    rows and its old time is read as it is now, never from the old conversion."""
    cache = str(tmp_path / "cache")
    path = write(kind, tmp_path, "qa", st_rows(4), ("anchor", "positive", "negative"))
    first = [e.query for e in load_hf([path], 1, cache_dir=cache)]
    stat = path.stat()
    changed = [{**r, "anchor": r["anchor"].replace("question", "QUESTION")} for r in st_rows(4)]
    write(kind, tmp_path, "qa", changed, ("anchor", "positive", "negative"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    again = [e.query for e in load_hf([path], 1, cache_dir=cache)]
    assert sorted(again) == sorted(q.replace("question", "QUESTION") for q in first)


@pytest.mark.parametrize("kind", ["folder", "parquet", "jsonl"])
def test_a_dataset_without_rows_is_named_as_empty(tmp_path, kind):
    path = write(kind, tmp_path, "empty", [])
    with pytest.raises(DataError) as refused:
        load_hf([path], 1)
    assert str(refused.value) == f"{path}: the dataset has no rows; give one with (query, positive) rows"


def test_repeated_pairs_and_negatives_equal_to_their_positive_warn_as_json_lines_does(tmp_path, caplog):
    """The JSON-lines loader's two warnings (one function, llm2vec.dataset.records.check_report), by row; the
    rows are kept."""
    rows = [{"query": f"q{i}", "positive": f"p{i}", "negative": f"n{i}"} for i in range(8)]
    rows[4] = {**rows[1], "negative": "another negative"}  # row 4 repeats the pair of row 1
    rows[6] = dict(rows[1])  # row 6 too
    rows[2]["negative"] = " " + rows[2]["positive"]  # row 2: the same text once stripped
    path = write("parquet", tmp_path, "d", rows)
    with caplog.at_level(logging.WARNING, logger="llm2vec.dataset"):
        ds = load_hf([path], 1, require_negative=True)
    assert len(ds) == 8
    warnings = " | ".join(r.getMessage() for r in caplog.records)
    assert f"{path}: 2 of 8 records repeat the query and positive of an earlier record (rows 4, 6)" in warnings
    assert f"{path}: 1 of 8 records has a negative equal to its positive (row 2)" in warnings


def test_a_text_longer_than_a_json_lines_line_is_refused_naming_dataset_row_and_field(tmp_path, monkeypatch):
    """A text over llm2vec.io.MAX_LINE_BYTES (the JSON-lines reader's bound) is refused before it is tokenized (a
    20 MB row took 30 s and 4.2 GB to tokenize, to keep max_seq_length tokens of it); the test lowers the bound."""
    import llm2vec.dataset.hf

    monkeypatch.setattr(llm2vec.dataset.hf, "MAX_LINE_BYTES", 1000)
    rows = [{"query": f"q{i}", "positive": f"p{i}"} for i in range(4)]
    rows[2]["positive"] = "é" * 501  # 1,002 bytes, 501 characters
    path = write("parquet", tmp_path, "big", rows)
    with pytest.raises(DataError) as error:
        load_hf([path], 1)
    message = str(error.value)
    assert message.startswith(f'{path}, row 2: field "positive" holds 1,002 bytes, more than 1,000'), message
    assert len(message.splitlines()) == 1
    rows[2]["positive"] = "é" * 500  # 1,000 bytes: read
    assert len(load_hf([write("parquet", tmp_path, "fits", rows)], 1)) == 4
