"""Packaging for the `llm2vec` package of anchor-embedding.

Lower bounds are the versions this project was tested with (2026-11). There are no upper bounds: none of
the dependencies is known to break us; if one does, pin it here with a comment that says why.
"""

from setuptools import find_packages, setup

setup(
    name="llm2vec",
    version="0.1.0",
    description="Anchor Embedding: training LLMs to be better text embedders through bidirectional reconstruction",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=find_packages(include=["llm2vec", "llm2vec.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.13.0",
        "transformers>=5.23.0",
        "peft>=0.21.2",
        "accelerate>=1.15.0",
        "datasets>=5.2.0",
        "mteb>=2.26.24",
        "numpy>=2.4",
        "tqdm>=4.70",
        "safetensors>=0.8.0",
    ],
    extras_require={
        "flash": ["flash-attn>=2.8"],
        # optional, CUDA only: Liger's fused LM head + cross-entropy for Stage I's logit_chunk_rows
        "liger": ["liger-kernel>=0.6"],
        # the offline demo: GGUF loading of SmolLM2 and the loss plot
        "demo": ["gguf>=0.19.0", "matplotlib>=3.10"],
        # sentence-transformers export (experiments/export_sentence_transformers.py)
        "st": ["sentence-transformers>=6.2.0"],
        # TensorBoard logs when report_to says tensorboard (the Trainer's own callback writes them)
        "tensorboard": ["tensorboard>=2.20"],
        "test": [
            "pytest>=9.0",
            "gguf>=0.19.0",
            "matplotlib>=3.10",
            "sentence-transformers>=6.2.0",
            "tensorboard>=2.20",
        ],
    },
)
