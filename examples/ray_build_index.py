"""Build an embedingest index from a Ray Dataset, on a local Ray or on a cluster.

    pip install -e ".[ray]"
    python examples/make_corpus.py corpus/
    python examples/ray_build_index.py corpus/ indexes/ray            # CPU actors
    python examples/ray_build_index.py corpus/ indexes/ray --gpus 1   # an actor per GPU
    embedingest search indexes/ray "how do I parse a date"

The JSON-lines files of the corpus folder (``.jsonl``, also ``.gz`` or ``.zst``) are read
with ``ray.data.read_json``; each record needs a unique ``id`` and a ``text``. The corpus
may be a prefix in object storage (``s3://bucket/docs/``, ``gs://...``): its files are
listed as the CLI lists them and read by Ray Data, credentials coming from the
environment (``AWS_*``, ``~/.aws``) on every node. Running the same command again embeds only
new and changed records and drops deleted ones. On a cluster (``--address auto``, or
``ray job submit``), give the index as an ``s3://bucket/prefix`` (each actor uploads its
own shards) or a folder every node sees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", help="folder (or s3://, gs:// prefix) of .jsonl files with 'id' "
                                   "and 'text' fields")
    ap.add_argument("out", help="index folder, or s3://bucket/prefix")
    ap.add_argument("--address", default=None, help="Ray cluster to join (default: a local Ray)")
    ap.add_argument("--actors", type=int, default=None,
                    help="EmbedBatches actors (default: one per GPU with --gpus, else the "
                         "CPUs less one, which reading the files needs)")
    ap.add_argument("--gpus", type=float, default=0, help="GPUs per actor (0: CPU actors)")
    ap.add_argument("--records-per-call", type=int, default=8192)
    ap.add_argument("--query", default="how do I parse a date", help="searched at the end")
    args = ap.parse_args()

    import ray

    from embedingest import build_index_ray, open_index

    files = jsonl_files(args.corpus)
    if not files:
        sys.exit(f"no .jsonl files in {args.corpus}; write some with: "
                 f"python examples/make_corpus.py {args.corpus}")
    ray.init(address=args.address, include_dashboard=False)
    try:
        actors = args.actors or default_actors(ray.cluster_resources(), args.gpus)
        dataset = ray.data.read_json(files)
        summary = build_index_ray(dataset, args.out, concurrency=actors, num_gpus=args.gpus,
                                  records_per_call=args.records_per_call, progress=True)
    finally:
        ray.shutdown()
    print(json.dumps(summary, indent=2))
    with open_index(args.out) as index:
        (hits,) = index.search([args.query], k=3)
    for hit in hits:
        print(f"{hit.score:.3f}  {hit.record_id}  {(hit.text or '')[:100]}")


def jsonl_files(corpus: str) -> list[str]:
    """The JSON-lines files below ``corpus``, a folder or a URL, in the order build-index
    takes them."""
    from embedingest.sources.files import walk_files
    from embedingest.sources.remote import is_remote, local_path, walk_remote

    if is_remote(corpus):
        return [obj.url for obj in walk_remote(corpus, JSON_LINES)]
    root = Path(local_path(corpus))
    return [str(path) for path in walk_files(root, JSON_LINES)] if root.is_dir() else []


JSON_LINES = {".jsonl", ".jsonl.gz", ".jsonl.zst"}


def default_actors(resources: dict, gpus: float) -> int:
    """Actors that fit the cluster while a CPU stays free to read the dataset: actors
    holding every CPU would leave the read tasks waiting for one forever."""
    if gpus:
        return max(1, int(resources.get("GPU", 0) // gpus))
    return max(1, int(resources.get("CPU", 2)) - 1)


if __name__ == "__main__":
    main()
