"""Write a sentence-transformers folder with the bundled model's tokenizer and pooling but
a larger BERT of random weights, to time a model heavier than all-MiniLM-L6-v2.

Throughput depends on a model's shape, not on its weights, and a real base-size model
(440 MB) cannot travel to the GPU machine; this one is made there, in seconds, from the
carried fp16 copy of the bundled model. The default shape is BERT-base (12 layers,
hidden 768), the shape of bge-base, e5-base or all-mpnet-base.

    python benchmarks/random_model.py DEST [--source FOLDER] [--layers 12 --hidden 768]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from embedingest.stages.model_folder import SOURCE_FILE


def write_random_model(source: Path, dest: Path, layers: int, hidden: int, seed: int = 0) -> str:
    """Copy ``source`` (a BERT sentence-transformers folder) to ``dest`` with a random
    ``layers`` x ``hidden`` BERT in fp16; return the name recorded for it."""
    from transformers import BertConfig, BertModel

    source, dest = Path(source), Path(dest)
    shutil.copytree(source, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                  intermediate_size=4 * hidden)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**config)).to(torch.float16)
    model.save_pretrained(dest, safe_serialization=True)
    pooling = dest / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps(json.loads(pooling.read_text()) | {"word_embedding_dimension": hidden}))
    name = f"random-bert-L{layers}-H{hidden}"
    (dest / SOURCE_FILE).write_text(json.dumps({"name": name, "source": str(source),
                                                "weights": f"random, seed {seed}, float16"}) + "\n")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--source", type=Path, default=None,
                        help="folder whose tokenizer and pooling to use (default: the bundled model)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args(argv)
    if args.source is None:
        from carry_model import bundled_model_dir

        args.source = bundled_model_dir()
    name = write_random_model(args.source, args.dest, args.layers, args.hidden)
    print(f"wrote {args.dest} ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
