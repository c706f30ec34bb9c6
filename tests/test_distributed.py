"""The end of a distributed run: the driver releases its process group at exit, after collecting the DDP wrapper
that still uses it (one gloo process here).
"""

import torch


def test_release_frees_the_dropped_ddp_wrapper_then_destroys_the_group(tmp_path):
    """What a driver leaves at exit: a DDP wrapper nobody references (not yet collected: it sits in a reference
    cycle, as a Trainer's does) and the live group. The release collects the wrapper before the group goes."""
    import gc
    import weakref

    import torch.distributed as dist

    from llm2vec.distributed import release_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        wrapper = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        holder = {"model": wrapper}
        holder["self"] = holder  # a cycle: only the garbage collector frees it
        alive = weakref.ref(wrapper)
        del wrapper, holder
        gc.disable()  # no collection may happen by chance before the release
        try:
            assert alive() is not None and dist.is_initialized()
            release_process_group()
            assert alive() is None and not dist.is_initialized()
        finally:
            gc.enable()
        release_process_group()  # nothing left to release: a no-op
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_finished_driver_run_releases_the_group_at_exit(monkeypatch):
    import atexit

    from llm2vec import distributed, training

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(distributed, "_release_registered", False)
    monkeypatch.setattr(training, "run", lambda stage, argv: None)
    assert training.main("II", ["config.json"]) == 0
    assert training.main("II", ["config.json"]) == 0  # a second run in the same process registers nothing more
    assert registered == [distributed.release_process_group]
