"""segment --out s3://...: each mask (and overlay, logits) lands in the bucket with the
bytes a run into a local folder writes, resumed by the objects there (moto's S3 server on
127.0.0.1)."""

from __future__ import annotations

import functools
import json

import pytest
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from segment_fixtures import small  # noqa: F401 (fixture)
from segment_fixtures import SIZE, bad_files, image_tree, noise, refused_either_way, small_config

from embedingest import segment
from embedingest.errors import ConfigError
from embedingest.index.lock import RUN_LOCK


segment_config = functools.partial(small_config, num_workers=0, num_consumers=2)


def local_files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in ("skipped.jsonl", RUN_LOCK)}  # the lock: a local run's only


@pytest.mark.slow
def test_masks_land_in_the_bucket_with_the_local_bytes_and_resume(s3, tmp_path, small):
    images = tmp_path / "images"
    sizes = image_tree(images)
    bad = bad_files(images)
    local = tmp_path / "local"
    url = s3.url("masks/run")
    kw = {"overlay": True, "save_logits": True}
    s1 = segment(segment_config(images, local, small, **kw), progress=False)
    s2 = segment(segment_config(images, url, small, **kw), progress=False)
    assert s2["written"] == s1["written"] == len(sizes) and s2["skipped"] == s1["skipped"] == len(bad)
    assert s2["out"] == url and s2["report"] == f"{url}/skipped.jsonl"
    want = local_files(local)
    assert len(want) == 3 * len(sizes) + 1  # mask, overlay, logits per image; labels.json
    s3.fs.invalidate_cache()
    got = {p.split("masks/run/", 1)[1]: s3.fs.cat_file(p) for p in s3.fs.find(f"{s3.name}/masks/run")}
    report = got.pop("skipped.jsonl")
    assert got == want
    assert sorted(json.loads(line)["path"] for line in report.decode().splitlines()) == \
        sorted(str(images / rel) for rel in bad)

    from PIL import Image

    Image.fromarray(noise(20, 30, seed=3)).save(images / "late.png")
    again = segment(segment_config(images, url, small, **kw), progress=False)
    assert (again["written"], again["already_done"]) == (1, len(sizes))
    s3.fs.invalidate_cache()
    assert s3.fs.exists(f"{s3.name}/masks/run/late.png.png")
    # the report keeps the earlier run's entries once each
    lines = s3.fs.cat_file(f"{s3.name}/masks/run/skipped.jsonl").decode().splitlines()
    assert len(lines) == len(bad)


def test_labels_of_other_settings_and_stats_are_refused(s3, tmp_path, small):
    s3.put("m/labels.json", json.dumps({"arch": "fcn_resnet50", "num_classes": 3}).encode())
    images = tmp_path / "images"
    image_tree(images)
    with pytest.raises(ConfigError, match=r"s3://.*/m holds masks made with other settings"):
        segment(segment_config(images, s3.url("m"), small), progress=False)
    with pytest.raises(ConfigError, match="--stats writes a table that grows in place"):
        segment(segment_config(images, s3.url("m"), small, stats=True), progress=False)
    with pytest.raises(ConfigError, match="cannot list 's3://no-such-bucket-here'"):
        segment(segment_config(images, "s3://no-such-bucket-here/m", small), progress=False)


def test_an_unfinished_overwrite_into_a_bucket_is_finished_by_an_overwrite_only(s3, tmp_path, small, monkeypatch):
    """The local folder's rule in object storage: an --overwrite stopped part-way leaves
    its mark object, a resume is refused (it would keep the masks made before as done),
    and the overwrite that redoes every image removes the mark."""
    import embedingest.jobs.segment as job
    from embedingest.jobs.segment.overwrite_mark import OVERWRITING

    images = tmp_path / "images"
    sizes = image_tree(images)
    url = s3.url("masks/over")
    mark = f"{s3.name}/masks/over/{OVERWRITING}"
    assert segment(segment_config(images, url, small), progress=False)["written"] == len(sizes)
    real = job.segment_on_device

    def stopped(config, *args, before_writes=None, **kw):
        before_writes()
        raise KeyboardInterrupt  # after the labels and the mark, before the images are all redone

    monkeypatch.setattr(job, "segment_on_device", stopped)
    with pytest.raises(KeyboardInterrupt):
        segment(segment_config(images, url, small, overwrite=True), progress=False)
    monkeypatch.setattr(job, "segment_on_device", real)
    s3.fs.invalidate_cache()
    assert s3.fs.exists(mark)
    with pytest.raises(ConfigError) as err:
        segment(segment_config(images, url, small), progress=False)
    assert str(err.value) == (f"a segment --overwrite run into {url!r} stopped before it redid every image, "
                              "so masks made with the settings before it may remain beside its own: run it "
                              "again with --overwrite")
    assert segment(segment_config(images, url, small, overwrite=True), progress=False)["written"] == len(sizes)
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(mark)
    assert segment(segment_config(images, url, small), progress=False)["already_done"] == len(sizes)


def test_objects_below_the_marks_name_are_refused_and_left_alone(s3, tmp_path, small):
    """A tampered prefix: objects below ``OUT/.overwrite-unfinished/``. Before, every resume
    was refused as an unfinished overwrite and an --overwrite never cleared it (it removed
    its own mark object only). Now both say what it is and what to do; the objects stay."""
    from embedingest.jobs.segment.overwrite_mark import OVERWRITING

    images = tmp_path / "images"
    sizes = image_tree(images)
    url = s3.url("masks/tampered")
    assert segment(segment_config(images, url, small), progress=False)["written"] == len(sizes)
    s3.put(f"masks/tampered/{OVERWRITING}/notes.txt", b"mine")
    want = (f"{url}/{OVERWRITING} is a prefix with objects below it, not the mark (an object) that segment "
            "--overwrite keeps there while it redoes the images: move or delete it, then run again")
    refused_either_way(lambda overwrite: segment(segment_config(images, url, small, overwrite=overwrite),
                                                 progress=False), want)
    s3.fs.invalidate_cache()
    assert s3.fs.cat_file(f"{s3.name}/masks/tampered/{OVERWRITING}/notes.txt") == b"mine"
    s3.fs.rm_file(f"{s3.name}/masks/tampered/{OVERWRITING}/notes.txt")
    assert segment(segment_config(images, url, small), progress=False)["already_done"] == len(sizes)


def test_a_photograph_replaced_in_the_bucket_is_redone_on_a_resume(s3, tmp_path, small):
    """Photographs and masks in one bucket, whose store stamps both: a photograph uploaded
    again after its mask was written (another picture under the same name) is redone on
    the next run and its mask replaced; the other masks are not written again."""
    import io
    import time

    import numpy as np
    from PIL import Image

    images = tmp_path / "images"
    sizes = image_tree(images)
    url, out = s3.upload(images, "photos"), s3.url("masks/run")
    assert segment(segment_config(url, out, small), progress=False)["written"] == len(sizes)

    def masks() -> dict[str, str]:
        s3.fs.invalidate_cache()
        return {p: s3.fs.info(p)["LastModified"] for p in s3.fs.find(f"{s3.name}/masks/run")
                if p.endswith((".png.png", ".jpg.png", ".webp.png", ".bmp.png", ".tif.png"))}

    before = masks()
    assert len(before) == len(sizes)
    time.sleep(1.1)  # the store keeps times to the second
    new = io.BytesIO()
    Image.fromarray(np.full((SIZE, SIZE, 3), 200, np.uint8)).save(new, "PNG")  # rgb.png was noise
    s3.put("photos/rgb.png", new.getvalue())
    again = segment(segment_config(url, out, small), progress=False)
    assert (again["written"], again["already_done"]) == (1, len(sizes) - 1)
    after = masks()
    replaced = f"{s3.name}/masks/run/rgb.png.png"
    assert after[replaced] > before[replaced], "written again"
    assert {p: e for p, e in after.items() if p != replaced} == {p: e for p, e in before.items() if p != replaced}
    mask = np.asarray(Image.open(io.BytesIO(s3.fs.cat_file(replaced))))
    assert mask.shape == (SIZE, SIZE) and len(np.unique(mask)) == 1  # one colour in, one class out
    assert segment(segment_config(url, out, small), progress=False)["written"] == 0
