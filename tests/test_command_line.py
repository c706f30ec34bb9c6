"""The command line's one-line messages: an unknown flag or field is blamed where it was written, with the closest
field; a short run's warm-up is warned about; a missing adapter folder fails before the data loads; bf16 on a
machine without it names the setting to change; a finished run names its model folder; an inherited max_length is
logged; the export names the flag of a wrong base; CPU runs do not pin memory."""

import importlib.util
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from _drivers import tiny_run_flags
from _tiny_data import write_tiny_e5

from llm2vec import LLM2Vec
from llm2vec.arguments import ConfigError, parse_config
from llm2vec.testing import build_tiny_model, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return save_tiny_model("llama3", root / "model"), write_tiny_e5(root / "data", n=8, sources=("nq",)), root


def flags(setup, **fields):
    model, data, root = setup
    return tiny_run_flags(model, data, root / "out", **fields)


# ---------------------------------------------------------------------------------------------- unknown names


def test_an_unknown_flag_is_blamed_on_the_command_line_with_the_closest_field(setup, tmp_path):
    config = tmp_path / "stage_I.json"
    config.write_text(json.dumps({"model_name_or_path": str(setup[0]), "output_dir": str(tmp_path / "o")}))
    with pytest.raises(ConfigError) as error:
        parse_config("I", [str(config), "--learing_rate", "1e-3"])
    message = str(error.value)
    assert message.startswith("command line: ") and str(config) not in message
    assert "--learing_rate: did you mean --learning_rate?" in message and "\n" not in message


def test_an_unknown_json_field_names_the_file_and_the_closest_field(setup, tmp_path):
    config = tmp_path / "stage_I.json"
    fields = {"model_name_or_path": str(setup[0]), "output_dir": str(tmp_path / "o"), "warmup_stpes": 2}
    config.write_text(json.dumps(fields))
    with pytest.raises(ConfigError) as error:
        parse_config("I", [str(config), "--max_steps", "2"])
    assert str(error.value).startswith(f"{config}: unknown field(s) for Stage I: ['warmup_stpes']")
    assert "'warmup_stpes': did you mean 'warmup_steps'?" in str(error.value)
    # a name close to nothing gets no guess; one of the other stage says so
    with pytest.raises(ConfigError) as error:
        parse_config("I", flags(setup, zzzqqq=1, loss_scale=50))
    assert "did you mean" not in str(error.value) and "loss_scale: Stage II only" in str(error.value)


# ---------------------------------------------------------------------------------------------- warm-up


def test_a_run_shorter_than_its_warm_up_is_warned_about_with_both_values(setup, caplog):
    """By the schedule plan (whatever the data, max_steps sets the horizon)."""
    from llm2vec.schedule import plan_schedule

    config = parse_config("I", flags(setup, max_steps=3, warmup_steps=15, learning_rate=1e-3))
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        plan_schedule(config.training, 1, None)
    (message,) = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert "max_steps 3" in message and "warmup_steps 15" in message
    # the peak the run reaches, from transformers' own linear schedule: steps 0, 1, 2 of 15 warm-up steps
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_linear_schedule_with_warmup(optimizer, 15, 3)
    reached = max(schedule.lr_lambdas[0](step) for step in range(3))
    assert f"at most {100 * reached:.0f} %" in message and round(100 * reached) == 13

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        plan_schedule(parse_config("I", flags(setup, max_steps=100, warmup_steps=15)).training, 1, None)
    assert not [r for r in caplog.records if "warmup_steps" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- adapter path


def test_a_missing_adapter_folder_fails_before_the_data_loads(setup, tmp_path, monkeypatch):
    import llm2vec.training as training

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded before the adapter path was checked")

    monkeypatch.setattr(training, "load_data", no_data)
    missing = tmp_path / "stage_II_typo"
    argv = flags(setup, peft_model_name_or_path=str(missing), output_dir=str(tmp_path / "o"))
    with pytest.raises(ConfigError) as error:
        training.run("II", argv)
    assert f"peft_model_name_or_path '{missing}' is not a folder" in str(error.value)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------- bf16


@pytest.fixture
def no_bf16_device(monkeypatch):
    """A machine with no GPU or XLA device that runs bf16 (as transformers' TrainingArguments tells)."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(transformers.utils, "is_torch_xla_available", lambda: False)


def test_bf16_without_a_bf16_device_stops_in_one_line_naming_the_setting_and_the_file(setup, tmp_path, no_bf16_device):
    """``"bf16": true`` (the README's own-model config) on a machine without bf16 stops, naming the setting to change
    in the file it came from, the flag, and ``--use_cpu true`` (bf16 on the CPU) as the other way."""
    config = tmp_path / "my_run.json"
    config.write_text(
        json.dumps({"model_name_or_path": str(setup[0]), "output_dir": str(tmp_path / "o"), "bf16": True})
    )
    with pytest.raises(ConfigError) as error:
        parse_config("I", [str(config)])
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{config}: ")
    assert f'set "bf16": false in {config} (or pass --bf16 false)' in message and "--use_cpu true" in message
    with pytest.raises(ConfigError) as error:  # given as a flag: the flag is what to change
        parse_config(
            "I", ["--model_name_or_path", str(setup[0]), "--output_dir", str(tmp_path / "o"), "--bf16", "true"]
        )
    assert "pass --bf16 false" in str(error.value) and '"bf16"' not in str(error.value)
    for fix in (["--bf16", "false"], ["--use_cpu", "true"]):  # either way named runs
        assert parse_config("I", [str(config), *fix]).training.bf16 is (fix[0] == "--use_cpu")


# ---------------------------------------------------------------------------------------------- CPU runs


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinned memory is right with an accelerator")
def test_a_cpu_run_does_not_pin_memory_nor_warn(setup):
    args = parse_config("I", flags(setup, use_cpu=None)).training  # use_cpu alone already turns pinning off
    assert args.dataloader_pin_memory is False
    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    with warnings.catch_warnings(record=True) as pinned:  # torch's own warning, to show what is avoided
        warnings.simplefilter("always")
        list(torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True))
    assert any("pin_memory" in str(w.message) for w in pinned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(torch.utils.data.DataLoader(data, batch_size=2, pin_memory=args.dataloader_pin_memory))
    assert not [w for w in caught if "pin_memory" in str(w.message)]
    # a config that asks for it keeps it
    assert (
        parse_config("I", flags(setup, use_cpu=None, dataloader_pin_memory="true")).training.dataloader_pin_memory
        is True
    )


# ---------------------------------------------------------------------------------------------- max_length


def test_an_inherited_max_length_is_logged_and_an_explicit_one_wins(tmp_path, caplog):
    causal_lm, tokenizer = build_tiny_model("llama3")
    folder = tmp_path / "trained"
    LLM2Vec(causal_lm.model, tokenizer, max_length=64).save(str(folder))
    saved = json.loads((folder / "llm2vec_config.json").read_text())["max_length"]
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        model = LLM2Vec.from_pretrained(str(folder), device="cpu")
    (message,) = [r.getMessage() for r in caplog.records if "inherited" in r.getMessage()]
    assert model.max_length == saved == 64
    assert message.startswith("max_length 64: inherited from") and "llm2vec_config.json" in message
    assert "max_length=" in message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        model = LLM2Vec.from_pretrained(str(folder), device="cpu", max_length=128)
    assert model.max_length == 128 and not [r for r in caplog.records if "inherited" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- the export


def export_main():
    spec = importlib.util.spec_from_file_location("export_cli", ROOT / "experiments/export_sentence_transformers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize(
    ("base", "expected"),
    [("bad name!", "is neither a folder here nor a hub id"), ("./output/stage_I/typo", "no such folder")],
)
def test_the_export_names_the_flag_of_a_wrong_base(tmp_path, capsys, base, expected):
    code = export_main()(
        ["--base_model_name_or_path", base, "--query_instruction", "", "--output_dir", str(tmp_path / "x")]
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1
    assert f"--base_model_name_or_path {base!r}" in errors[0] and expected in errors[0]
    assert "Repo id" not in errors[0] and "hub id" in errors[0]


# ---------------------------------------------------------------------------------------------- reading flags


def test_flags_are_read_one_way_for_the_config_and_the_drivers_debug(setup, tmp_path):
    from llm2vec.arguments import flag_groups, load_config
    from llm2vec.training import _debug_flag

    assert flag_groups(["--a=1", "--b", "x", "y", "--c"]) == [("a", ("1",)), ("b", ("x", "y")), ("c", ())]
    with pytest.raises(ConfigError, match="expected --field, got 'x'"):
        flag_groups(["x", "--a"])
    with pytest.raises(ConfigError, match="--a is given twice"):
        load_config(["--a", "1", "--a=2"])
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"max_steps": 5, "learning_rate": 0.1}))
    merged, source = load_config([str(config), "--max_steps=2"])
    assert source == str(config) and merged["learning_rate"] == 0.1 and merged["max_steps"].values == ("2",)
    for argv, rest, debug in [
        (["--debug", "--max_steps", "2"], ["--max_steps", "2"], True),
        (["--max_steps", "2", "--debug", "false"], ["--max_steps", "2"], False),
        (["--debug=1"], [], True),
        ([str(config), "--debug", "underflow_overflow"], [str(config), "--debug", "underflow_overflow"], False),
    ]:
        assert _debug_flag(argv) == (rest, debug), argv
