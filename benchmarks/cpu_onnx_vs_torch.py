"""The bundled encoder's forward on the CPU: torch against ONNX Runtime (the query
encoder's runtime, stages/onnx_forward.py) on one batch of long chunks, side by side.

    python benchmarks/cpu_onnx_vs_torch.py --batch 32 --tokens 256 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from embedingest.stages.encoder import TextEncoder
from embedingest.stages.onnx_forward import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    enc = TextEncoder.load(device="cpu")
    onnx = load(enc, Path(tempfile.mkdtemp()), threads=args.threads)
    ids = torch.randint(1000, 20000, (args.batch, args.tokens))
    mask = torch.ones_like(ids)
    for name, forward in (("torch", enc.forward), ("onnx", onnx)) * 2:  # interleaved, twice
        forward(ids, mask)
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            forward(ids, mask)
        print(f"{name}: {(time.perf_counter() - t0) / args.repeat:.3f} s per {args.batch}x{args.tokens}",
              flush=True)
    print("largest difference:", float((enc.forward(ids, mask) - onnx(ids, mask)).abs().max()))


if __name__ == "__main__":
    main()
