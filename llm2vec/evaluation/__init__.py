"""Evaluation helpers: MTEB result tables in the paper's layout (:mod:`llm2vec.evaluation.tables`)."""
