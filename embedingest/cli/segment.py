"""``embedingest segment``: a segmentation model over images, a mask per image.

Options map one-to-one onto :class:`SegmentConfig` fields (IMAGES is the argument) and
default to None, so a ``--config`` preset, or else the dataclass default, applies unless
the option is given. The job is imported when the command runs, so ``embedingest
--help`` does not load torch.
"""

from __future__ import annotations

import json
import sys

import click

from ..errors import EmbedingestError
from ..exit_codes import EXIT_INTERRUPTED
from ..report import passed_over_sentence
from .common import import_interruptibly


@click.command("segment")
@click.argument("images", type=click.Path(exists=True, path_type=str))
@click.option("--out", type=click.Path(file_okay=False), help="Output folder; masks mirror the input tree.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="TOML preset of these options (configs/segment.toml).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False),
              help="State dict or checkpoint. Default: torchvision's file in the torch hub cache.")
@click.option("--arch", help="Any torchvision segmentation model: deeplabv3_resnet50 (default), "
                             "deeplabv3_resnet101, deeplabv3_mobilenet_v3_large, fcn_resnet50, "
                             "fcn_resnet101, lraspp_mobilenet_v3_large.")
@click.option("--num-classes", type=int, help="Classes of the weights (read from the file; a check).")
@click.option("--random-weights/--no-random-weights", default=None,
              help="Use random weights when none are found (pipeline tests only).")
@click.option("--resize", type=click.Choice(["short", "fit"]),
              help="short: the weights' own preprocessing (short side to --size, no pad; "
                   "images batched by shape); fit: fitted into a --size square, padded. [short]")
@click.option("--size", type=int, help="Short side of the model input (short; the weights' "
                                       "preset is 520), or the square's side (fit). [520]")
@click.option("--upsample-max-pixels", type=int,
              help="Images up to this many pixels get masks from logits scaled to their size "
                   "(torchvision's pipeline); larger ones the model-size argmax scaled up "
                   "nearest-neighbour. [40000000]")
@click.option("--batch-size", type=int, help="Images per forward pass. [16]")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
              help="Model precision; auto is fp16 on CUDA, fp32 on CPU.")
@click.option("--device", help="auto, cuda, cuda:N or cpu.")
@click.option("--devices", help="Several devices, one process each, images split between them: "
                                "all, 0,1, cuda:0,cuda:1 (or cpu,cpu to try it).")
@click.option("--num-workers", type=int,
              help="DataLoader processes decoding images (-1: the cores but two, shared "
                   "between devices). [-1]")
@click.option("--num-consumers", type=int, help="Processes writing masks. [4]")
@click.option("--num-slots", type=int, help="Engine host slots; 0 is twice the consumers.")
@click.option("--save-logits/--no-save-logits", default=None,
              help="Also write float16 per-class scores (<image>.logits.npy).")
@click.option("--overlay/--no-overlay", default=None,
              help="Also write <image>.overlay.jpg, the classes blended over the image.")
@click.option("--overlay-alpha", type=float, help="Weight of the class colours in overlays. [0.5]")
@click.option("--stats/--no-stats", default=None,
              help="Also write stats/*.parquet: a row per image (source, width, height, share "
                   "of each class), resumable like the masks.")
@click.option("--stats-commit-seconds", type=float,
              help="Seconds between commits of each writer's stats rows (a killed run loses "
                   "at most these; their images are redone). [10]")
@click.option("--overwrite/--no-overwrite", default=None,
              help="Redo images whose mask exists (default: skip them, i.e. resume).")
@click.option("--max-pixels", type=int, help="Skip larger images with a reason; 0: no limit.")
@click.option("--timeline", type=click.Path(dir_okay=False),
              help="Write a PNG timeline of the last batches (compute, copies, consumers).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Write every batch's engine records as a Chrome trace (JSON; Perfetto, "
                   "chrome://tracing); one device only.")
def segment_command(images, config_path, as_json, timeline, trace, **options) -> None:
    """A torchvision segmentation model over the images under IMAGES (or one image): a PNG
    mask per image, at the image's own size, in OUT, with OUT/labels.json saying what the
    values mean.

    Re-running skips images whose mask exists. Exit status: 0 all images done; 3 finished
    but some images were skipped (see skipped.jsonl in OUT); 1 error; 130 interrupted
    (re-run the same command to resume).
    """
    from ..config import load_config

    try:
        job = import_interruptibly("embedingest.jobs.segment")
        config = load_config(job.SegmentConfig, config_path, images=images, **options)
        summary = job.segment(config, progress=not as_json, timeline=timeline, trace=trace)
    except (EmbedingestError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:  # disk full, permissions, I/O errors, in a sink too
        raise click.ClickException(f"{exc}; every mask written before is kept: fix the cause "
                                   "and run the same command again") from exc
    except KeyboardInterrupt:
        click.echo("\ninterrupted: every mask written so far is kept; run the same command "
                   "again to resume", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        click.echo(_paragraph(summary))
    sys.exit(summary["exit_code"])


def _paragraph(s: dict) -> str:
    skipped = (f"{s['skipped']} skipped ({', '.join(f'{k}: {v}' for k, v in s['skipped_by_reason'].items())}; "
               f"list in {s['report']})" if s["skipped"] else "nothing skipped")
    ran = (f" on {s['device']} ({s['dtype']}, weights: {s['model']})" if "device" in s else "")
    return (f"Segmented {s['written']} of {s['images']} images in {s['seconds']:.1f} s "
            f"({s['images_per_s']:,.1f} images/s){ran}; {s['already_done']} already done, "
            f"{skipped}.{passed_over_sentence(s)} Masks are in {s['out']}.")
