"""Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), full-parameter.

    torchrun --nproc_per_node=8 experiments/run_stage_I.py train_configs/stage_I/MetaLlama3.2_1b_q2d_d2q.json
    python experiments/run_stage_I.py CONFIG.json --max_steps 10    # flags override the JSON
"""

from llm2vec.training import run_cli, run_stage_I

if __name__ == "__main__":
    run_cli(run_stage_I)
