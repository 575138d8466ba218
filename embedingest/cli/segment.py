"""``embedingest segment``: a segmentation model over images, a mask per image.

Options map one-to-one onto :class:`SegmentConfig` fields (IMAGES is the argument) and
default to None, so a ``--config`` preset, or else the dataclass default, applies unless
the option is given. The job is imported when the command runs, so ``embedingest
--help`` does not load torch.
"""

from __future__ import annotations

import click

from ..config import SegmentConfig
from ..exit_codes import exit_status_help
from ..report import passed_over_sentence
from ..terminal import rate
from .common import InputPath, command_config, config_options, library_errors, run_job, run_options


@click.command("segment", help=f"""A torchvision segmentation model over the images under IMAGES (or one
    image): a PNG mask per image, at the image's own size, in OUT, with OUT/labels.json saying what
    the values mean. IMAGES may be a URL (s3://bucket/prefix, ...), with credentials from the
    environment.

    Re-running skips images whose mask exists.

    {exit_status_help("all images done", "images", "OUT")}""")
@click.argument("images", type=InputPath())
@config_options(SegmentConfig, skip=("images",))
@run_options("configs/segment.toml",
             timeline="Write a PNG timeline of the last batches (compute, copies, consumers).",
             trace="Write every batch's engine records as a Chrome trace (JSON; Perfetto, "
                   "chrome://tracing); one device only.")
@library_errors(kept="every mask written before is kept")
def segment_command(images, config_path, as_json, timeline, trace, **options) -> None:
    config = command_config(SegmentConfig, config_path, images=images, **options)
    run_job("embedingest.jobs.segment",
            lambda job: job.segment(config, progress=not as_json, timeline=timeline, trace=trace),
            as_json=as_json, paragraph=_paragraph,
            interrupted=("every mask written so far is kept; run the same command again: with "
                         "--overwrite it redoes every image (the folder is refused without it until "
                         "an --overwrite run finishes)" if config.overwrite else
                         "every mask written so far is kept; run the same command again to resume"))


def _paragraph(s: dict) -> str:
    skipped = (f"{s['skipped']} skipped ({', '.join(f'{k}: {v}' for k, v in s['skipped_by_reason'].items())}; "
               f"list in {s['report']})" if s["skipped"] else "nothing skipped")
    ran = (f" on {s['device']} ({s['dtype']}, weights: {s['model']})" if "device" in s else "")
    return (f"Segmented {s['written']} of {s['images']} images in {s['seconds']:.1f} s "
            f"({rate(s['images_per_s'])} images/s){ran}; {s['already_done']} already done, "
            f"{skipped}.{passed_over_sentence(s)} Masks are in {s['out']}.")
