"""The paper's pipeline end to end, offline, on a laptop CPU: SmolLM2-135M-Instruct, Stage I, Stage II
(Anchor and Baseline), mteb evaluation of the four rows of Table 10, and the Stage II loss plot (Figure 4).

    python experiments/run_demo.py            # about 20 minutes on 2 CPU cores; outputs in cache/demo-runs/
    python experiments/run_demo.py --smoke    # tiny random model, 2 steps per stage (CI); cache/demo-smoke/
    python experiments/run_demo.py --fresh    # redo every step

Finished steps are reused on the next run. All logic lives in :mod:`llm2vec.demo.pipeline`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm2vec.demo.pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
