"""MTEB evaluation of LLM2Vec models (mteb 2.x).

- :mod:`~llm2vec.evaluation.mteb_wrapper`: the mteb encoder with the paper's instruction routing
  (:class:`LLM2VecMTEBEncoder`), :func:`load_instructions` and :func:`evaluate`;
- :mod:`~llm2vec.evaluation.replicas`: encoding on several devices at once;
- :mod:`~llm2vec.evaluation.benchmark`: the paper's tasks, categories, splits and subsets, read from a
  tasks file, and the mteb tasks restricted to them;
- :mod:`~llm2vec.evaluation.local_task`: a local BEIR-style folder as an mteb retrieval task;
- :mod:`~llm2vec.evaluation.result_keys`: what a stored result was computed from, and when :func:`evaluate`
  serves it again;
- :mod:`~llm2vec.evaluation.tables`: the paper's result tables from mteb result folders.

Every function takes the files it reads as arguments; nothing here has default paths.
"""
