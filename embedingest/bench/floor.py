"""The least a command can take: a fresh interpreter that imports torch, loads the encoder
and runs its forward over chunks already tokenized (read from a file), then ends.

No build-index, however it reads, cuts and tokenizes, can finish sooner than this on
the same machine: it has to start the interpreter, import torch, start CUDA, load the
weights and run the same forward too. The bench runs it as a fresh process beside
build-index, so a row's distance to the forward alone splits into what any command pays
(this row) and what build-index adds to it.

    python -m embedingest.bench.floor BATCHES.npz --device cuda --dtype fp16 [--model FOLDER]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def save_batches(path: Path, batches: list) -> None:
    """``batches`` (token ids and masks, as :func:`~.documents.sorted_batches` gives them)
    to ``path``: each batch's ids as int32 and its rows' lengths."""
    import numpy as np

    arrays = {}
    for n, (ids, mask) in enumerate(batches):
        arrays[f"ids{n}"] = ids.numpy().astype(np.int32)
        arrays[f"len{n}"] = mask.sum(dim=1).numpy().astype(np.int32)
    np.savez(path, **arrays)


def load_batches(path: Path, device: str = "cpu"):
    """The batches :func:`save_batches` wrote, as token ids and masks (int64) on ``device``."""
    import numpy as np
    import torch

    stored = np.load(path)
    for n in range(len(stored.files) // 2):
        ids = torch.from_numpy(stored[f"ids{n}"]).to(device, non_blocking=True).long()
        lengths = torch.from_numpy(stored[f"len{n}"]).to(device, non_blocking=True)
        yield ids, (torch.arange(ids.shape[1], device=device) < lengths[:, None]).long()


def run(path: Path, model: str | None, device: str, dtype: str) -> int:
    """The forward over the batches in ``path``, each batch moved to the device as the job
    moves its batches; the number of chunks."""
    import torch

    from ..stages.encoder import TextEncoder

    enc = TextEncoder.load(model, device=device, dtype=dtype)
    chunks = 0
    with torch.inference_mode():
        for ids, mask in load_batches(path, device):
            enc.forward(ids, mask)
            chunks += ids.shape[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batches", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="fp16")
    args = parser.parse_args()
    chunks = run(args.batches, args.model, args.device, args.dtype)
    sys.stdout.write(f"{chunks}\n")
    sys.stdout.flush()
    os._exit(0)  # as the command ends: no teardown of torch and CUDA object by object


if __name__ == "__main__":
    main()
