"""Encoding on several devices: one model replica per device (:func:`replicate`), fed by threads from a shared queue."""

from __future__ import annotations

import contextlib
import copy
import queue
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import torch
from tqdm.auto import tqdm

from ..devices import default_device
from ..keywords import strict_booleans
from ..llm2vec import LLM2Vec


def resolve_devices(devices: str | torch.device | Sequence[str | torch.device] | None) -> list[torch.device]:
    """``"auto"``/None: every visible CUDA device, else ``[cpu]``; a string or device: that one; a list: those."""
    if devices is None or devices == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] if n else [default_device()]
    if isinstance(devices, (str, torch.device)):
        return [torch.device(devices)]
    device_list = [torch.device(d) for d in devices]
    if not device_list:
        raise ValueError("devices: empty list")
    return device_list


def replicate(model: LLM2Vec, devices: Sequence[torch.device]) -> list[LLM2Vec]:
    """One copy of ``model`` on each device (the original object becomes the last replica), in eval mode."""
    replicas = [copy.deepcopy(model).to(d) for d in devices[:-1]]
    replicas.append(model.to(devices[-1]))
    for r in replicas:
        r.eval()
    return replicas


@strict_booleans
def encode_on_replicas(
    replicas: Sequence[LLM2Vec],
    items: Sequence[Sequence[str]],
    *,
    batch_size: int,
    chunk_size: int | None = None,
    show_progress_bar: bool = True,
) -> np.ndarray:
    """Embed ``[instruction, text]`` items on all ``replicas`` at once (float32, input order), ``chunk_size`` items
    (default ``4 * batch_size``) a work unit; a worker's exception is raised here."""
    if not replicas:
        raise ValueError("at least one replica is needed")
    if not items:
        raise ValueError("nothing to encode: no items")
    # longest first, by characters: cheap, and LLM2Vec.encode re-sorts each chunk by tokens
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]) - len(items[i][1]))
    chunk = int(chunk_size or 4 * batch_size)
    free: queue.SimpleQueue[LLM2Vec] = queue.SimpleQueue()  # the replicas no thread is using
    for replica in replicas:
        free.put(replica)

    def embed(indices: list[int]) -> tuple[list[int], np.ndarray]:
        replica = free.get()
        try:
            cuda = replica.device.type == "cuda"
            with torch.cuda.device(replica.device) if cuda else contextlib.nullcontext():
                texts = [items[i] for i in indices]
                emb = replica.encode(texts, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True)
            return indices, np.asarray(emb, dtype=np.float32)
        finally:
            free.put(replica)

    out = None
    bar = tqdm(total=len(items), desc=f"Encoding on {len(replicas)} devices", disable=not show_progress_bar)
    with bar, ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        work = [pool.submit(embed, order[start : start + chunk]) for start in range(0, len(order), chunk)]
        try:
            for done in as_completed(work):
                indices, emb = done.result()
                out = np.empty((len(items), emb.shape[1]), dtype=np.float32) if out is None else out
                out[indices] = emb
                bar.update(len(indices))
        except BaseException:
            for future in work:  # the others stop after their current chunk
                future.cancel()
            raise
    return out
