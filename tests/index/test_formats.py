"""A format-1 index is refused with the command that rebuilds it, never misread."""

import json
import os
import subprocess

import pytest
from index_fixtures import build_v1
from shard_fixtures import build_shards

from embedingest.errors import ConfigError
from embedingest.index.formats import index_format, rebuild_command, require_current


def test_a_format_1_index_is_refused_with_the_exact_rebuild_command(tmp_path):
    folder = tmp_path / "old index"
    built = build_v1(folder)
    data = json.loads((folder / "manifest.json").read_text())
    data["corpus_path"] = "/data/my corpus"
    (folder / "manifest.json").write_text(json.dumps(data))
    built.store.close()
    assert index_format(folder) == 1
    with pytest.raises(ConfigError) as err:
        require_current(folder)
    assert str(err.value) == (
        f"the index at {str(folder)!r} is in format 1 (chunk metadata in metadata.sqlite), which this "
        "embedingest no longer reads. Rebuild it in format 2 with:\n"
        f"  embedingest build-index '/data/my corpus' --out '{folder}' --model test-model --index Flat "
        "--overwrite")


def test_metadata_sqlite_means_format_1_whatever_the_manifest_says(tmp_path):
    build_shards(tmp_path / "ix", n_units=1, chunks=2, workers=1)
    assert index_format(tmp_path / "ix") == 2
    require_current(tmp_path / "ix")
    (tmp_path / "ix" / "metadata.sqlite").write_bytes(b"")
    assert index_format(tmp_path / "ix") == 1
    with pytest.raises(ConfigError, match="is in format 1"):
        require_current(tmp_path / "ix")


def test_a_manifest_without_format_is_format_1_and_records_say_how_to_rebuild(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {"name": "m"}, "dim": 4, "factory": "HNSW32",
                                                        "metric": "l2"}))
    assert index_format(tmp_path) == 1
    with pytest.raises(ConfigError) as err:
        require_current(tmp_path)
    assert (f"  embedingest build-index CORPUS --out {tmp_path} --model m --index HNSW32 --metric l2 "
            "--overwrite (CORPUS: the folder or file it was built from") in str(err.value)


def test_newer_formats_ask_for_a_newer_embedingest_and_no_index_passes(tmp_path):
    assert index_format(tmp_path) is None
    require_current(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {}, "dim": 4, "format": 3}))
    with pytest.raises(ConfigError, match=r"has format 3, newer than this embedingest reads \(format 2\)"):
        require_current(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {}, "dim": 4, "format": "2"}))
    with pytest.raises(ConfigError, match="manifest.json: format is '2', not an integer"):
        index_format(tmp_path)


@pytest.mark.parametrize("text", ['{"name": "my dataset", "files": ["a.csv"]}', '{"model": "resnet"}',
                                  '{"model": "x", "dim": 1536}', "[1, 2]", "name: my dataset\n"])
def test_another_programs_manifest_is_no_index_and_no_index_advice_deletes_it(tmp_path, text):
    """A folder whose manifest.json is not an index's (neither 'model' nor 'dim', or not
    JSON) and that holds none of an index's other files is another program's: refused as
    such, never as a damaged index to rebuild with --overwrite (which deletes the file)."""
    (tmp_path / "manifest.json").write_text(text)
    (tmp_path / "shards").mkdir()  # a folder of the user's of that name, without a shard's record
    (tmp_path / "shards" / "part-0.bin").write_bytes(b"d")
    with pytest.raises(ConfigError) as err:
        index_format(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{str(tmp_path / 'manifest.json')!r} ")
    assert message.endswith(", and the folder holds no units.sqlite or shards/: it is not an embedingest "
                            "index but another program's file; give the index a folder of its own "
                            "(build-index --out), or move that file away")
    assert "--overwrite" not in message


@pytest.mark.parametrize("beside", ["units.sqlite", "shards"])
def test_a_damaged_manifest_beside_index_files_is_a_damaged_index(tmp_path, beside):
    if beside == "shards":  # a shard's commit record (damaged or not): an index's
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / "shard-r1-w0-00000.commit.json").write_text("{")
    else:
        (tmp_path / beside).write_bytes(b"")
    (tmp_path / "manifest.json").write_text('{"metric": "ip"')
    with pytest.raises(ConfigError, match=r"Expecting .*; rebuild the index with --overwrite$"):
        index_format(tmp_path)
    (tmp_path / "manifest.json").write_text('{"metric": "ip", "format": 2}')
    assert index_format(tmp_path) == 2  # read_manifest then names the missing fields
    (tmp_path / "manifest.json").write_text("[" * 200_000)  # nested past Python's stack: a RecursionError
    with pytest.raises(ConfigError, match=r"maximum recursion depth.*; rebuild the index with --overwrite$"):
        index_format(tmp_path)


def test_rebuild_command_quotes_what_the_shell_would_split():
    cmd = rebuild_command("out dir", {"corpus_path": "a b", "model": {"path": "/m x"},
                                      "factory": "IVF64,Flat"}, save_embeddings=True)
    assert cmd == ("embedingest build-index 'a b' --out 'out dir' --model '/m x' --index IVF64,Flat "
                   "--save-embeddings --overwrite")


@pytest.mark.parametrize("data", [
    [1, 2],  # not an object
    {"model": "m", "corpus_path": 5, "factory": "", "metric": 3},  # fields of the wrong types
    {"model": {"name": 7, "path": ""}, "corpus_path": "", "factory": ["Flat"], "metric": "ip"},
])
def test_a_damaged_format_1_manifest_still_gets_the_rebuild_command(tmp_path, data):
    """What the manifest says wrongly is left out of the command, never crashes it."""
    folder = tmp_path / "ix"
    folder.mkdir()
    (folder / "metadata.sqlite").write_bytes(b"")
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        require_current(folder)
    assert str(err.value).endswith(
        f"  embedingest build-index CORPUS --out {folder} --overwrite (CORPUS: the folder or file it was "
        "built from; an index of records is rebuilt by build_index(records, out=..., overwrite=True))")


def test_the_rebuild_command_quotes_what_the_shell_would_split(tmp_path):
    manifest = {"model": {"path": "/my models/m"}, "corpus_path": "/data/it's here", "factory": "IVF4,PQ8",
                "metric": "l2"}
    assert rebuild_command(tmp_path / "a b", manifest, save_embeddings=True) == (
        f"embedingest build-index '/data/it'\"'\"'s here' --out '{tmp_path}/a b' --model '/my models/m' "
        "--index IVF4,PQ8 --metric l2 --save-embeddings --overwrite")


@pytest.mark.parametrize("text, problem", [
    ("[1, 2]", "format is None"),  # not an object
    ('{"format": true}', "format is True"),  # a bool is no format number
    ('{"format": 2.0}', "format is 2.0"),
])
def test_a_manifest_whose_format_is_not_an_integer_is_refused_exactly(tmp_path, text, problem):
    (tmp_path / "units.sqlite").write_bytes(b"")  # an index's folder: its manifest is damaged
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        index_format(tmp_path)
    assert str(err.value) == (f"{tmp_path / 'manifest.json'}: {problem}, not an integer: the manifest was "
                              "changed or damaged; rebuild the index with --overwrite")


def test_a_manifest_that_is_not_json_is_named_with_what_to_do(tmp_path):
    (tmp_path / "units.sqlite").write_bytes(b"")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        index_format(tmp_path)
    path = str(tmp_path / "manifest.json")
    assert str(err.value).startswith(f"cannot read {path!r}: Expecting property name")
    assert str(err.value).endswith("; rebuild the index with --overwrite")


def test_a_segments_folder_means_format_1_only_with_a_format_1_shard_in_it(tmp_path):
    """A folder of the user's named ``segments`` (masks, say) is no index: it was taken
    for format 1, refused, and --overwrite, as the refusal said, deleted it whole."""
    (tmp_path / "segments").mkdir()
    assert index_format(tmp_path) is None
    (tmp_path / "segments" / "mask.png").write_bytes(b"png")
    assert index_format(tmp_path) is None
    (tmp_path / "segments" / "seg-r-w0-00000.faiss").write_bytes(b"\0" * 64)
    assert index_format(tmp_path) == 1
    for path in (tmp_path / "segments").iterdir():
        path.unlink()
    (tmp_path / "segments").rmdir()
    (tmp_path / "segments").write_text("a file of that name is not format 1's folder")
    assert index_format(tmp_path) is None


def test_a_newer_format_is_refused_naming_the_folder(tmp_path):
    folder = tmp_path / "ix"
    folder.mkdir()
    (folder / "units.sqlite").write_bytes(b"")
    (folder / "manifest.json").write_text(json.dumps({"format": 7}))
    with pytest.raises(ConfigError) as err:
        require_current(folder)
    assert str(err.value) == (f"the index at {str(folder)!r} has format 7, newer than this embedingest reads "
                              "(format 2): upgrade embedingest")


def test_the_rebuild_command_names_the_model_as_a_build_here_would_load_it(tmp_path):
    """The manifest's model name is a local folder's name alone (``mymodel``): the path is
    given for it; the name only where it loads the same model (the bundled one), or where
    the path is not here and the name is a model id (as search falls back to it)."""
    from embedingest.stages.model_folder import BUNDLED_NAME, resolve_model

    here = tmp_path / "my models" / "mymodel"
    here.mkdir(parents=True)
    bundled = str(resolve_model(None)[0])
    for model, option in [({"name": "mymodel", "path": str(here)}, f"'{here}'"),
                          ({"name": "mymodel", "path": "/gone/mymodel"}, "/gone/mymodel"),
                          ({"name": "org/m", "path": "/gone/models--org--m/snapshots/abc"}, "org/m"),
                          ({"name": BUNDLED_NAME, "path": bundled}, BUNDLED_NAME),
                          ({"name": BUNDLED_NAME, "path": str(here)}, f"'{here}'"),  # a copy of it
                          ({"name": BUNDLED_NAME, "path": "/other/machine/model"}, BUNDLED_NAME),
                          ({"name": "mymodel"}, "mymodel")]:
        assert rebuild_command("ix", {"corpus_path": "/c", "model": model, "factory": "Flat"}) == (
            f"embedingest build-index /c --out ix --model {option} --index Flat --overwrite"), model


def test_the_rebuild_command_names_a_corpus_whose_name_is_not_utf8_by_its_bytes(tmp_path):
    """Before: a corpus named b'bad\\xff.txt' was printed 'bad\\udcff.txt' (a lone surrogate,
    shlex-quoted), which names no file once pasted; now bash's $'...' gives its bytes."""
    corpus = os.fsencode(tmp_path) + b"/bad\xff\n.txt"
    with open(corpus, "wb") as fh:
        fh.write(b"text")
    cmd = rebuild_command(tmp_path / "o", {"corpus_path": os.fsdecode(corpus), "factory": "Flat"}, options=["-q"])
    assert "\\xff\\x0a" in cmd and "\udcff" not in cmd and "\n" not in cmd
    args = subprocess.run(["bash", "-c", f"printf '%s\\0' {cmd}"], capture_output=True, check=True).stdout
    assert args.split(b"\0")[:-1] == [b"embedingest", b"build-index", corpus, b"--out", os.fsencode(tmp_path / "o"),
                                      b"--index", b"Flat", b"-q", b"--overwrite"]
    assert subprocess.run(["bash", "-c", f"cat {cmd.split()[2]}"], capture_output=True).stdout == b"text"
