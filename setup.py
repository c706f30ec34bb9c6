"""Packaging for the `llm2vec` package of anchor-embedding.

Every lower bound is a version the test suite runs at: CI (`.ci/run`) installs the newest releases for the whole
suite, then a second environment with every dependency at exactly its bound here (`.ci/lower_bounds.py` reads
them from this file) for the tests listed in `tests/lower_bounds.txt`. The bounds are the releases current when
transformers 5.17 came out (2026-09), the transformers of the project's GPU machine, so that a cluster that pins
torch 2.11 or transformers 5.17 need not upgrade. The code that differs between transformers 5.17 and newer
releases is in `llm2vec/compat.py`. There are no upper bounds: none of the dependencies is known to break us; if
one does, pin it here with a comment that says why.
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
    # the published facts and chat templates of the tiny models that llm2vec.testing builds
    package_data={"llm2vec": ["published/*.json", "published/*.jinja", "published/*.md"]},
    python_requires=">=3.10",
    install_requires=[
        # the torch of the GPU machine; PyPI's build of it is the CUDA one, which CI runs on CPU (about 4.5 GB with
        # its NVIDIA libraries; the CPU-only wheel of 2.11 is not on PyPI)
        "torch>=2.11.0",
        # the GPU machine's; before 5.19 the Trainer ignores loss_is_scaled_for_ga, before 5.23 there is no
        # activation_checkpointing argument: llm2vec/compat.py handles both
        "transformers>=5.17.0",
        "peft>=0.20.0",  # the release current at transformers 5.17
        "accelerate>=1.14.0",  # the release current at transformers 5.17
        "datasets>=5.0.0",  # the first 5.x release
        "mteb>=2.20.0",  # the first 2.2x release; the evaluation's mteb API (abstasks, AbsEncoder) as in 2.26
        "numpy>=2.2.0",
        "tqdm>=4.67.1",
        "safetensors>=0.8.0",  # what transformers 5.17 itself requires
    ],
    extras_require={
        # CUDA only, so never installed by CI (no GPU): these two bounds are not tested here
        "flash": ["flash-attn>=2.8"],
        # optional, CUDA only: Liger's fused LM head + cross-entropy for Stage I's logit_chunk_rows
        "liger": ["liger-kernel>=0.6"],
        # the offline demo: GGUF loading of SmolLM2 and the loss plot
        "demo": ["gguf>=0.19.0", "matplotlib>=3.10.0"],
        # the sentence-transformers export and Stage II path (trainer: sentence_transformers). 6.2: 6.0 and 6.1's
        # CachedGISTEmbedLoss fails with a guide model of another tokenizer (it moves non-tensor features to the
        # guide's device); tests/test_st_stage_II.py runs at this bound
        "st": ["sentence-transformers>=6.2.0"],
        # TensorBoard logs when report_to says tensorboard (the Trainer's own callback writes them)
        "tensorboard": ["tensorboard>=2.20.0"],
        "test": [
            "pytest>=9.0.0",
            # the README's test command runs the suite in two processes (-n 2, a test file to a process)
            "pytest-xdist>=3.8.0",
            "gguf>=0.19.0",
            "matplotlib>=3.10.0",
            "sentence-transformers>=6.2.0",
            "tensorboard>=2.20.0",
        ],
    },
)
