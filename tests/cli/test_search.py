"""``embedingest search``: a shard copied in from another index is refused by name with
what to do; search parameters the index does not take are named as the --params given."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner
from corpus_fixtures import TOPICS
from index_pair_fixtures import FAST, copy_shard, drop_shard, shard_names

from embedingest import build_index
from embedingest.cli import main



def search(index, *args):
    return CliRunner().invoke(main, ["search", str(index), *args])


def test_a_shard_of_another_index_in_place_of_one_is_refused_until_taken_out(indexes):
    """b's first shard in place of a's first: the same unit numbers, no id twice, so every
    check of a damaged shard passed. Before: search answered with b's texts and files
    (b1.txt, 'Whales are marine mammals...', in an index of a's files). Now search says
    which shard is not this index's, and taking it out as told (then build-index) gives
    the index of a's files whole."""
    a, b = indexes / "a", indexes / "b"
    mine, theirs = shard_names(a)[0], shard_names(b)[0]
    drop_shard(a, mine)
    copy_shard(b, theirs, a)
    r = search(a, TOPICS[7])
    assert r.exit_code == 1
    assert (f"Error: shard {theirs} ({str(a / 'shards' / (theirs + '.parquet'))!r}) is not this index's: its "
            "row of id ") in r.output
    assert "of this index is 'a" in r.output and f"(in {str(a / 'units.sqlite')!r}); it was copied in" in r.output
    assert r.output.rstrip().endswith(
        f"move its files (every file named {theirs}.*) out of the index and put back the shard of this index "
        f"it took the place of (the manifest lists {mine}, not in the folder), or run the same build-index "
        "command again, which deletes it and redoes the units it held")
    aside = indexes / "aside"
    aside.mkdir()
    for path in (a / "shards").glob(f"{theirs}.*"):
        shutil.move(path, aside / path.name)
    s = build_index(indexes / "corpus_a", out=str(a), **FAST)
    assert s["units_indexed"] == 3 and s["vectors_total"] == 6
    r = search(a, TOPICS[7], "-k", "10", "--json")
    assert r.exit_code == 0, r.output
    hits = json.loads(r.output)
    assert sorted(h["source"] for h in hits) == [f"a{i}.txt" for i in range(6)]
    assert all(h["text"] == TOPICS[int(h["source"][1])] for h in hits)


def test_a_shard_of_another_index_holding_this_index_s_ids_is_refused(indexes):
    """b's second shard (units 4..6) in place of a's first: a's second shard holds those
    ids. Before: a hit of b's vectors got a's row of its id (a3.txt's text for b3's
    vector), so one text came twice and the ranking lied."""
    a, b = indexes / "a", indexes / "b"
    first, second = shard_names(a)
    theirs = shard_names(b)[1]
    drop_shard(a, first)
    copy_shard(b, theirs, a)
    r = search(a, TOPICS[9])
    assert r.exit_code == 1
    assert (f"Error: shard {theirs} ({str(a / 'shards' / (theirs + '.parquet'))!r}), which the manifest does not "
            f"list, holds ids that shard {second} holds too (e.g. id {4 << 32}: unit 4, chunk 0): it is not this "
            "index's (copied in from another index, or left by a build that was stopped); move its files "
            f"(every file named {theirs}.*) out of the index") in r.output


def test_search_parameters_the_index_does_not_take_are_named_as_the_option_given(indexes, tmp_path):
    """Before: `search parameters 'nprobe=4' do not apply to shard-20261206T...-w0-00000 (factory
    'Flat'): ParameterSpace::set_index_parameter:could not set parameter nprobe`, naming an
    internal file and not the option; now the option, the value, and what the index takes."""
    a = indexes / "a"
    r = search(a, "bread", "--params", "nprobe=4")
    assert r.exit_code == 2  # a setting refused in an option: usage status
    assert r.output.endswith(
        f"Error: search parameters 'nprobe=4' do not apply to the index at {str(a)!r} (factory 'Flat'): --params "
        "'nprobe=4': it has no parameter nprobe; it takes no search parameters: leave out --params\n")
    assert "shard-" not in r.output
    ivf = tmp_path / "ivf"
    build_index([{"id": f"r{i}", "text": t} for i, t in enumerate(TOPICS)], out=str(ivf), index="IVF2,Flat",
                train_size=12, **FAST)
    r = search(ivf, "bread", "--params", "efSearch=16")
    assert r.exit_code == 2
    assert r.output.endswith(
        f"Error: search parameters 'efSearch=16' do not apply to the index at {str(ivf)!r} (factory 'IVF2,Flat'): "
        "--params 'efSearch=16': it has no parameter efSearch; it takes nprobe (1 to 2), max_codes: e.g. --params "
        "'nprobe=2'\n")
    manifest = json.loads((a / "manifest.json").read_text())
    manifest["search"] = {"params": "nprobe=4"}  # the index's own, as an older build stored them
    (a / "manifest.json").write_text(json.dumps(manifest))
    r = search(a, "bread")
    assert r.exit_code == 1
    assert r.output == (f"Error: search parameters 'nprobe=4' do not apply to the index at {str(a)!r} (factory "
                        "'Flat'): they are the index's own (build-index --search-params), and it has no parameter "
                        "nprobe; it takes no search parameters: pass others (--params '' for none) or store others "
                        "with build-index --search-params\n")
    assert search(a, "bread", "--params", "").exit_code == 0
