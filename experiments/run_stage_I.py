"""Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), full-parameter.

torchrun --nproc_per_node=8 experiments/run_stage_I.py train_configs/stage_I/MetaLlama3.2_1b_q2d_d2q.json
python experiments/run_stage_I.py CONFIG.json --max_steps 10    # flags override the JSON
python experiments/run_stage_I.py --help                       # every field
"""

import sys

from llm2vec import training


def main(argv: list[str] | None = None) -> int:
    return training.main("I", argv)


if __name__ == "__main__":
    sys.exit(main())
