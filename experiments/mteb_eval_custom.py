"""Evaluate an LLM2Vec / Anchor Embedding model on MTEB (mteb 2.x), one task, a task set or a local folder.

    python experiments/mteb_eval_custom.py --base_model_name_or_path <base> \
        --peft_model_name_or_path <adapter> --task_name <TASK> \
        --task_to_instructions_fp test_configs/mteb/task_to_instructions.json --output_dir <dir>

All logic lives in :mod:`llm2vec.evaluation.mteb_wrapper`; ``--help`` lists the options.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm2vec.evaluation.mteb_wrapper import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
