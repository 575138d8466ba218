"""How fast the bundled encoder could run on this CPU at most, in fp32 (or bf16): its matrix
products' floating-point work per 256-token chunk against this CPU's own matrix-product
rate (torch's BLAS at the model's largest shape), beside the forward as it runs
(embedingest's encoder) and sentence-transformers' ``encode()`` on the same chunks.

The ceiling assumes every operation of the forward ran at the GEMM rate and everything
else (attention's softmax, GELU, layer norms, pooling, tokenizing) were free; a build
cannot beat it without doing less work per chunk (a lower precision: other vectors).

    python benchmarks/cpu_gemm_ceiling.py --threads 2 --chunks 64
"""

from __future__ import annotations

import argparse
import time

import torch


def flops_per_chunk(layers: int, hidden: int, ffn: int, tokens: int) -> float:
    """Multiply-adds x 2 of one chunk: Q, K, V, the output projection and the two
    feed-forward products per token, and attention's two products per layer."""
    per_token = 4 * hidden * hidden + 2 * hidden * ffn
    attention = 2 * tokens * tokens * hidden
    return 2.0 * layers * (tokens * per_token + attention)


def gemm_rate(rows: int, hidden: int, ffn: int, dtype: torch.dtype = torch.float32,
              repeat: int = 10, tries: int = 5) -> float:
    """The best of ``tries`` timings: the CPU's rate, not another process's share of it."""
    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, ffn, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(repeat):
            a @ b
        best = max(best, 2.0 * rows * hidden * ffn * repeat / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=64, help="Chunks of --tokens tokens, in batches of 32.")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="both encoders' precision (bf16: where the CPU has bf16 products)")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from embedingest.stages.encoder import TextEncoder

    enc = TextEncoder.load(device="cpu", dtype=args.dtype)
    config = enc.model.config
    work = flops_per_chunk(config.num_hidden_layers, config.hidden_size, config.intermediate_size, args.tokens)
    ids = torch.randint(1000, 20000, (args.chunks, args.tokens))
    mask = torch.ones_like(ids)
    words = [" ".join(["the"] * (args.tokens - 2))] * args.chunks  # one token a word: full chunks
    st = SentenceTransformer(str(enc.model_dir), device="cpu")
    st.max_seq_length = args.tokens
    st = st.to(dtype)
    assert len(st.tokenizer(words[0])["input_ids"]) == args.tokens
    rates = {}
    for name in ("forward", "sentence-transformers") * 3:  # interleaved; each one's best counts
        t0 = time.perf_counter()
        if name == "forward":
            with torch.inference_mode():
                for i in range(0, args.chunks, 32):
                    enc.forward(ids[i:i + 32], mask[i:i + 32])
        else:
            st.encode(words, batch_size=32)
        rates[name] = max(rates.get(name, 0.0), args.chunks / (time.perf_counter() - t0))
    gemm = gemm_rate(32 * args.tokens, config.hidden_size, config.intermediate_size, dtype)
    ceiling = gemm / work
    print(f"work per chunk: {work / 1e9:.2f} GFLOP; {args.dtype} GEMM rate: {gemm / 1e9:.1f} GFLOP/s "
          f"({args.threads} threads) -> ceiling {ceiling:.1f} chunks/s")
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} chunks/s ({rate * work / 1e9:.1f} GFLOP/s, {rate / ceiling:.2f} of the ceiling)")
    print(f"ceiling / sentence-transformers: {ceiling / rates['sentence-transformers']:.2f}x")
    print(f"forward / sentence-transformers: {rates['forward'] / rates['sentence-transformers']:.2f}x")
    for op, share in op_shares(enc, ids[:32], mask[:32]):
        print(f"  forward's time in {op}: {share:.2f}")


def op_shares(enc, ids, mask, top: int = 5) -> list[tuple[str, float]]:
    """Where one batch's forward spends its time, by operator (torch's profiler): the
    matrix products should dominate if the GEMM rate is the bound."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        enc.forward(ids, mask)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            enc.forward(ids, mask)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [(e.key, e.self_cpu_time_total / total) for e in ranked]


if __name__ == "__main__":
    main()
