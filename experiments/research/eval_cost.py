"""What evaluation during training costs: the time of one evaluation against the training steps between two.

In one process, on SmolLM2-135M-Instruct (float32, CPU) and the demo's data, this times

- a Stage I training step (forward + backward of ``--batch`` pairs) and Stage I's evaluation
  (:func:`llm2vec.anchor_gain.anchor_gain`: two forward passes of every held-out pair, no backward);
- a Stage II training step (``--batch`` triples) and Stage II's evaluation
  (:func:`llm2vec.validation.contrastive_validation`: one forward per held-out text),

each as seconds per pair, and prints their ratio. The overhead of a run follows from its config:

    overhead = (eval seconds per pair x held-out pairs a process evaluates) / (eval_steps x train seconds per pair
               x pairs a process trains per step)

Stage I evaluates every held-out pair on every process; Stage II shares them among the processes. The
script prints that overhead for the paper configs' settings (8 processes; their per-device batch and
accumulation, ``validation_size`` and ``eval_steps``), assuming a GPU keeps the CPU's ratio of a forward pass to
a forward + backward pass (both are dominated by the same matrix products).

    python experiments/research/eval_cost.py          # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from anchor_sweep import train_examples, validation_examples  # noqa: E402
from demo import settings  # noqa: E402
from demo.stdlib_data import DEFAULT_OUT_DIR  # noqa: E402

from llm2vec.anchor_gain import anchor_gain  # noqa: E402
from llm2vec.collator import TrainCollator  # noqa: E402
from llm2vec.llm2vec_contrastive import LLM2VecContrastive  # noqa: E402
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q  # noqa: E402
from llm2vec.validation import contrastive_validation  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
PAPER = {"I": CONFIGS / "stage_I" / "MetaLlama3.2_1b_q2d_d2q.json", "II": CONFIGS / "stage_II"}


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=32, help="held-out pairs of one timed evaluation")
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = settings.REPO_ROOT / DEFAULT_OUT_DIR
    train = train_examples(data)[: args.batch]
    held = validation_examples(data, args.pairs)
    model_dir = str(settings.SMOLLM2_DIR)
    out = {}

    stage_I = LLM2Vec_q2d_d2q.load(model_dir, max_length=args.max_len)
    collate = TrainCollator.for_encoder(stage_I, reconstruction="text")
    batch = collate(train)

    def step_I():
        stage_I.train()
        stage_I(**batch).loss.backward()
        stage_I.zero_grad(set_to_none=True)

    eval_batches = [collate(held[i : i + 16]) for i in range(0, len(held), 16)]
    out["I"] = {
        "train_seconds_per_pair": median_seconds(step_I, args.repeats) / args.batch,
        "eval_seconds_per_pair": median_seconds(lambda: anchor_gain(stage_I, eval_batches), args.repeats) / len(held),
    }

    from peft import LoraConfig, get_peft_model

    stage_II = LLM2VecContrastive.load(model_dir, max_length=args.max_len)
    stage_II.model = get_peft_model(
        stage_II.model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    )
    collate_II = TrainCollator.for_encoder(stage_II, with_negative=True)
    batch_II = collate_II(train)

    def step_II():
        stage_II.train()
        stage_II(**batch_II).loss.backward()
        stage_II.zero_grad(set_to_none=True)

    collate_held = dataclasses.replace(collate_II, with_negative=False)  # the validation pairs have no hard negative

    def eval_II():
        contrastive_validation(
            stage_II,
            held,
            collate_held,
            batch_size=16,
            contrastive_batch=args.batch,
            scale=20.0,
            device=torch.device("cpu"),
        )

    out["II"] = {
        "train_seconds_per_pair": median_seconds(step_II, args.repeats) / args.batch,
        "eval_seconds_per_pair": median_seconds(eval_II, args.repeats) / len(held),
    }
    for stage, config_path in (("I", PAPER["I"]), ("II", next(iter(sorted(PAPER["II"].glob("*1b*stage2.json")))))):
        cfg = json.loads(config_path.read_text())
        ratio = out[stage]["eval_seconds_per_pair"] / out[stage]["train_seconds_per_pair"]
        processes = 8
        per_process = cfg["validation_size"] if stage == "I" else cfg["validation_size"] / processes
        trained = cfg["per_device_train_batch_size"] * cfg.get("gradient_accumulation_steps", 1) * cfg["eval_steps"]
        out[stage].update(
            ratio=ratio,
            config=config_path.name,
            validation_size=cfg["validation_size"],
            eval_steps=cfg["eval_steps"],
            overhead=ratio * per_process / trained,
        )
    print(json.dumps(out, indent=2))
    for stage, r in out.items():
        print(
            f"Stage {stage}: evaluation {r['ratio']:.2f}x a training step's time per pair; {r['config']} "
            f"(validation_size {r['validation_size']}, eval_steps {r['eval_steps']}, 8 processes): "
            f"{100 * r['overhead']:.1f} % of the training time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
