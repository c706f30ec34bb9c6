"""Stage II: LoRA contrastive fine-tuning (InfoNCE with in-batch and hard negatives).

    torchrun --nproc_per_node=8 experiments/run_stage_II.py train_configs/stage_II/MetaLlama3.2_1b_stage1_2000steps_stage2.json
    python experiments/run_stage_II.py CONFIG.json --max_steps 10    # flags override the JSON
"""

from llm2vec.stage_II import run_cli, run_stage_II

if __name__ == "__main__":
    run_cli(run_stage_II)
