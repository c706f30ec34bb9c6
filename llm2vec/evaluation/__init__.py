"""MTEB evaluation of LLM2Vec models (mteb 2.x): the encoder with the paper's instruction routing
(:mod:`~llm2vec.evaluation.mteb_wrapper`), the paper's benchmark and tables, local BEIR folders as tasks, and when
a stored result is served again. Every function takes the files it reads as arguments; nothing has default paths.
"""
