"""The offline CPU demo: a local SmolLM2 checkpoint, a small real dataset, and the one-command pipeline
(:mod:`llm2vec.demo.pipeline`, run by ``experiments/run_demo.py``)."""
