"""One rank of a Stage I run launched by torchrun (tests/test_fsdp.py): train, then report what FSDP did.

    python -m torch.distributed.run --nproc_per_node=2 tests/_fsdp_worker.py REPORT_DIR <Stage I flags>

Runs :func:`llm2vec.training.run` exactly as ``experiments/run_stage_I.py`` does, then writes
``REPORT_DIR/rank<k>.json``: whether the Trainer ran FSDP (accelerate's distributed type and plugin
version), which modules are sharded as units and which are activation-checkpointed, how many elements of
each parameter this rank holds (its shard) and the full sizes, and the loss history.
"""

from __future__ import annotations

import json
import os
import sys


def parameter_shards(model) -> dict[str, list[int]]:
    """name -> [elements held by this rank, elements of the full parameter] (FSDP2 parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = [local.numel(), p.numel()]
    return out


def allow_fsdp_on_cpu() -> None:
    """Let accelerate run FSDP on CPU processes (gloo), as it does on GPUs.

    accelerate (1.15) turns an FSDP plugin into ``DistributedType.FSDP`` only for accelerator devices
    (``MULTI_GPU``, ``MULTI_NPU``, ...); with ``use_cpu`` it stays ``MULTI_CPU`` and the plugin is silently
    dropped (plain DDP). This lifts that one check, so that the Trainer's own FSDP2 path (``fully_shard``,
    sharded optimizer, gathered ``FULL_STATE_DICT`` saves) runs unchanged on gloo.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # every later AcceleratorState() copies PartialState's MULTI_CPU back in; the plugin stays, so re-apply
        plugin = fsdp_plugin if fsdp_plugin is not None else getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init


def fsdp_modules(model) -> list[str]:
    """Class names of the modules FSDP2 sharded as units (``fully_shard`` makes them ``FSDPModule``s)."""
    from torch.distributed.fsdp import FSDPModule

    return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]


def main(argv: list[str]) -> int:
    report_dir, flags = argv[0], argv[1:]
    from llm2vec.training import run

    allow_fsdp_on_cpu()

    trainer = run("I", flags)
    state = trainer.accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    report = {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "distributed_type": str(state.distributed_type),
        "backend": getattr(state, "backend", None),
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "is_fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "shards": parameter_shards(trainer.model),
        "fsdp_modules": fsdp_modules(trainer.model),
        "checkpointed": [
            type(m._checkpoint_wrapped_module).__name__
            for m in trainer.model.modules()
            if hasattr(m, "_checkpoint_wrapped_module")
        ],
        "log_history": trainer.state.log_history,
    }
    os.makedirs(report_dir, exist_ok=True)
    with open(os.path.join(report_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
