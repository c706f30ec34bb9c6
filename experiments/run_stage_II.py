"""Stage II: LoRA contrastive fine-tuning (InfoNCE with in-batch and hard negatives).

torchrun --nproc_per_node=8 experiments/run_stage_II.py train_configs/stage_II/MetaLlama3.2_1b_stage1_2000steps_stage2.json
python experiments/run_stage_II.py CONFIG.json --max_steps 10    # flags override the JSON
python experiments/run_stage_II.py --help                       # every field
"""

import sys

from llm2vec import training


def main(argv: list[str] | None = None) -> int:
    return training.main("II", argv)


if __name__ == "__main__":
    sys.exit(main())
