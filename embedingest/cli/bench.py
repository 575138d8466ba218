"""``embedingest bench``: side-by-side benchmarks of the seed workloads."""

from __future__ import annotations

import click

from ..config import DTYPE_NAMES, MAX_SEGMENT_SIZE, SEGMENT_ARCHITECTURES
from .common import in_existing_folder, library_errors


class SideRange(click.ParamType):
    """``MIN,MAX``: two whole numbers of pixels, 16 <= MIN <= MAX, as a tuple."""

    name = "min,max"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            low, high = (int(p) for p in parts)
        except ValueError:
            self.fail(f"{value!r} is not MIN,MAX (two whole numbers of pixels, e.g. 240,1600)", param, ctx)
        if not 16 <= low <= high:
            self.fail(f"{value!r}: MIN must be at least 16 and at most MAX", param, ctx)
        return low, high


def machine_line(info: dict) -> str:
    """The table's first line: what it was measured on (``machine_info``)."""
    where = info.get("gpu", "CPU") + (f" driver {info['driver']}" if info.get("driver") else "")
    return f"# {where}, torch {info.get('torch')}, {info['date']}"


@click.group()
def bench() -> None:
    """Side-by-side benchmarks (the GPU parts need a CUDA GPU)."""


@bench.command("segmentation")
@click.option("--steps", type=click.IntRange(min=1), default=30, show_default=True, help="Timed steps for the fast loops.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Steps before the clock starts.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Images per step.  [default: 64; with --photos the job's 16]")
@click.option("--image-size", type=click.IntRange(min=32), default=512, show_default=True, help="Side of the square input images.")
@click.option("--consumers", type=click.IntRange(min=1), default=8, show_default=True,
              help="Consumer processes (seed loops and engine alike).")
@click.option("--slots", type=click.IntRange(min=1), default=12, show_default=True, help="Engine host slots.")
@click.option("--loader-workers", type=click.IntRange(min=0), default=8, show_default=True,
              help="DataLoader processes making the random images.")
@click.option("--only", default="", metavar="GROUPS",
              help="Comma list of the row groups to run: bound, seed, engine.  [default: all]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=in_existing_folder,
              help="Also write the rows and the machine here, as JSON.")
@click.option("--timeline", type=click.Path(dir_okay=False), callback=in_existing_folder,
              help="PNG timeline of the segment stage's bf16 full-logits run.")
@click.option("--photos", type=click.IntRange(min=1), help="Instead: the segment job on this many real photographs "
                                         "(varied sizes and aspect ratios) against the forward "
                                         "alone at the shapes it ran.")
@click.option("--photo-sides", type=SideRange(), default="240,1600", show_default=True, metavar="MIN,MAX",
              help="With --photos: the range of the photographs' long side, in pixels.")
@click.option("--photo-odd-share", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="With --photos: the share cropped to any ratio and size (each a shape of its own).")
@click.option("--photo-dir", type=click.Path(file_okay=False),
              help="With --photos: keep the photographs here (reused when it holds as many).")
@click.option("--arch", type=click.Choice(SEGMENT_ARCHITECTURES), default="deeplabv3_resnet50",
              show_default=True, metavar="NAME", help="With --photos: the segmentation model.")
@click.option("--size", type=click.IntRange(32, MAX_SEGMENT_SIZE), default=520, show_default=True, help="With --photos: the short side.")
@click.option("--device", default="auto", show_default=True, metavar="DEVICE",
              help="With --photos: auto, cuda, cuda:N or cpu (cpu to try it).")
@click.option("--trace", type=click.Path(dir_okay=False), callback=in_existing_folder,
              help="Chrome trace (JSON) of the segment stage's bf16 full-logits run, every batch; "
              "with --photos, of the timed job.")
@library_errors
def bench_segmentation(steps, warmup, batch_size, image_size, consumers, slots, loader_workers,
                       only, json_path, timeline, photos, photo_sides, photo_odd_share, photo_dir,
                       arch, size, device, trace) -> None:
    """The seed article's DeepLabV3 workload: its five loops, the forward-only bound and
    embedingest's engine, in one run. With --photos: the segment job end to end on real
    photographs against the model's forward alone at the shapes the job ran."""
    import torch

    if photos:
        from ..bench.report import machine_info, write_json
        from ..bench.segment_photos import PhotoBenchConfig, run, table

        from ..stages.device import resolve_device

        resolve_device(device)  # a name torch does not know, or no GPU: one line, before any work
        low, high = photo_sides
        cfg = PhotoBenchConfig(photos=photos, min_side=low, max_side=high, odd_share=photo_odd_share,
                               arch=arch, size=size, batch_size=batch_size or 16, device=device,
                               folder=photo_dir, trace=trace)
        info = machine_info()
        click.echo(machine_line(info))
        result = run(cfg, log=lambda m: click.echo(m, err=True))
        click.echo(table(result))
        if json_path:
            write_json(json_path, {"machine": info, "config": cfg.__dict__, "result": result})
        return
    batch_size = batch_size or 64

    if not torch.cuda.is_available():
        raise click.ClickException("this benchmark needs a CUDA GPU; torch sees none here")
    from ..bench.report import machine_info, table, write_json
    from ..bench.segmentation import SegBenchConfig, run_all

    cfg = SegBenchConfig(batch_size=batch_size, image_size=image_size, loader_workers=loader_workers,
                         consumers=consumers, slots=slots, warmup=warmup, steps=steps)
    select = {s.strip() for s in only.split(",") if s.strip()} or None
    info = machine_info()
    click.echo(machine_line(info))
    rows = run_all(cfg, select, log=lambda m: click.echo(m, err=True))
    click.echo(table(rows, "steps/s"))
    drawn = next((r for r in rows if r["name"] == "segment stage, bf16, logits, sink=devnull"), None)
    if timeline and drawn:
        from ..engine.timeline import render_timeline

        render_timeline(drawn["records"], timeline, spans=drawn["spans"], last_n=12,
                        title=f"segment stage, bf16, full logits, {info.get('gpu', '')}")
    if trace and drawn:
        from ..engine.telemetry import EngineStats
        from ..engine.trace import write_trace

        stats = EngineStats(device="cuda", records=drawn["records"], spans=drawn["spans"])
        write_trace(trace, [("cuda", stats)], title=f"segment stage, bf16, full logits, {info.get('gpu', '')}")
    for r in rows:
        r.pop("records", None)
        r.pop("spans", None)
    if json_path:
        write_json(json_path, {"machine": info, "config": cfg.__dict__, "rows": rows})


@bench.command("text")
@click.option("--corpus", type=click.Choice(("paragraphs", "documents")), default="paragraphs", show_default=True,
              help="paragraphs: --docs paragraphs of ~50 tokens, one chunk each; documents: the machine's "
                   "own documents (manual pages, package docs, the standard library), cut into many "
                   "chunks each, build-index run as a fresh command and timed from its start.")
@click.option("--docs", type=click.IntRange(min=1), default=200_000, show_default=True, help="Paragraphs (~50 tokens each).")
@click.option("--mb", type=click.FloatRange(min=0, min_open=True), default=80.0, show_default=True, help="With --corpus documents: megabytes of documents.")
@click.option("--copies", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --corpus documents: write each document this many times (a machine with few).")
@click.option("--join-mb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="With --corpus documents: join documents into files of about this many MB (0: one each).")
@click.option("--jsonl", is_flag=True,
              help="With --corpus documents: write the documents as records of one JSON lines file "
                   "(with --join-mb, files of about that many MB).")
@click.option("--parquet", is_flag=True,
              help="With --corpus documents: the same as --jsonl, as a Parquet file (pyarrow's default "
                   "row groups).")
@click.option("--st-sample", type=click.IntRange(min=0), default=20_000, show_default=True,
              help="With --corpus documents: chunks sentence-transformers encodes (0: no such row).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Chunks per batch, the same for every row.  [default: 256; with --corpus documents "
                   "1024, for the forward alone (build-index picks its own)]")
@click.option("--device", default="auto", show_default=True, metavar="DEVICE",
              help="auto (CUDA when available), cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(("auto", *DTYPE_NAMES)), default="auto", show_default=True,
              help="Precision of the encoder; auto is fp16 on CUDA, fp32 on the CPU.")
@click.option("--model", default=None, metavar="FOLDER|ID",
              help="Model folder or Hugging Face id in the local cache.  [default: the bundled all-MiniLM-L6-v2]")
@click.option("--num-workers", type=click.IntRange(min=-1), default=-1, show_default=True,
              help="build-index's tokenizer processes; -1 picks from the CPU count.")
@click.option("--num-consumers", type=click.IntRange(min=1), default=2, show_default=True, help="build-index's consumer processes.")
@click.option("--st-fp32/--no-st-fp32", default=True,
              help="Also time sentence-transformers in fp32.  [default: on]")
@click.option("--compare-eager/--no-compare-eager", default=True,
              help="On CUDA, also time the rows without CUDA graphs.  [default: on]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=in_existing_folder,
              help="Also write the rows and the machine here, as JSON.")
@click.option("--trace", type=click.Path(dir_okay=False), callback=in_existing_folder,
              help="Chrome trace (JSON) of the build-index row: its phases and every batch.")
@library_errors
def bench_text(corpus, docs, mb, copies, join_mb, jsonl, parquet, st_sample, batch_size, device, dtype, model, num_workers,
               num_consumers, st_fp32, compare_eager, json_path, trace) -> None:
    """sentence-transformers against build-index end to end, with the encoder's forward
    alone as the bound, on one corpus (runs on CPU too)."""
    from ..bench.report import TEXT_COLUMNS, machine_info, table, write_json
    from ..bench.text import TextBenchConfig, run_all

    from ..stages.device import precision, resolve_device

    device = str(resolve_device(device))  # a name torch does not know, or no GPU: one line, before any work
    dtype = precision(dtype, device.startswith("cuda"))
    if corpus == "documents":
        build_options = ["--num-workers", str(num_workers), "--num-consumers", str(num_consumers)]
        _bench_documents(mb, copies, join_mb, st_sample, batch_size or 1024, device, dtype, model, json_path,
                         build_options, trace, jsonl, parquet)
        return
    cfg = TextBenchConfig(docs=docs, batch_size=batch_size or 256, device=device, dtype=dtype, model=model,
                          num_workers=num_workers, num_consumers=num_consumers, st_fp32=st_fp32,
                          compare_eager=compare_eager, trace=trace)
    info = machine_info()
    click.echo(machine_line(info))
    rows = run_all(cfg, log=lambda m: click.echo(m, err=True))
    click.echo(table(rows, "docs/s", TEXT_COLUMNS))
    if json_path:
        write_json(json_path, {"machine": info, "config": cfg.__dict__,
                               "rows": [{k: v for k, v in r.items() if k != "summary"} for r in rows],
                               "build_index_summaries": [r["summary"] for r in rows if "summary" in r]})


def _bench_documents(mb, copies, join_mb, st_sample, batch_size, device, dtype, model, json_path,
                     build_options, trace, jsonl=False, parquet=False) -> None:
    from ..bench.documents import DocumentsBenchConfig, run_documents
    from ..bench.report import DOCUMENTS_COLUMNS, machine_info, table, write_json

    cfg = DocumentsBenchConfig(mb=mb, copies=copies, join_mb=join_mb, jsonl=jsonl, parquet=parquet, device=device, dtype=dtype,
                               model=model,
                               batch_size=batch_size, st_sample=st_sample, build_options=build_options,
                               trace=trace)
    info = machine_info()
    click.echo(machine_line(info))
    made, rows = run_documents(cfg, log=lambda m: click.echo(m, err=True))
    click.echo(table(rows, "chunks/s", DOCUMENTS_COLUMNS))
    if json_path:
        write_json(json_path, {"machine": info, "config": cfg.__dict__, "documents": made,
                               "rows": [{k: v for k, v in r.items() if k != "summary"} for r in rows],
                               "build_index_summaries": [r["summary"] for r in rows if "summary" in r]})
