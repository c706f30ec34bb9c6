"""The life of one spawned gloo worker of the two-process tests, in one place.

Every worker does the same around its own work (``body``): join the process group, run the work, wait for the
other rank, release the group and leave. Two things here are about leaving, not about what the tests check:

- ``body`` is a function of its own, so its models and DDP / FSDP wrappers (which hold the process group) are
  unreferenced once it returns; :func:`llm2vec.distributed.release_process_group` collects them and destroys
  the group, the order the training drivers use at exit.
- A worker whose work is done and saved then ends with ``os._exit(0)``, without the interpreter's teardown of
  torch's native state. That teardown aborted a finished worker now and then ("terminate called without an
  active exception", SIGABRT; two CI runs, once after a DDP test, once after an FSDP2 one), failing a test whose
  results were all correct. How a *driver* process exits is a property of the package and is tested where it
  belongs (tests/test_distributed.py); a failing ``body`` still raises, so mp.spawn reports its traceback.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable


def run_in_group(
    rank: int, world_size: int, init_file: str, body: Callable[[], None], timeout_s: float | None = None
) -> None:
    """Join the gloo group (file rendezvous at ``init_file``), run ``body()``, then leave as the module says."""
    import torch.distributed as dist

    from llm2vec.distributed import release_process_group

    options = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, **options)
    done = False
    try:
        body()
        dist.barrier()  # both ranks finished their collectives before either releases the group
        done = True
    finally:
        release_process_group()
    if done:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
