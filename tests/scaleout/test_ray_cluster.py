"""build_index_ray on a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``:
a head and a worker, each with a raylet and an object store of its own), one actor on
each: the index of the single-process build, and a worker node killed mid-run loses
nothing once the run is run again.

The index lives in a bucket of an S3-compatible server on 127.0.0.1 (moto's, started by
the tests): the driver works in a temporary folder of its own, each actor writes in
another and uploads its shards, so nothing passes through a shared local path; the
driver reads no record's text (see test_build_index_ray.py). Both builds give the ids,
vectors and rows of the single-process build of the same records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from s3_fixtures import s3, s3_endpoint, s3_environment  # noqa: F401 (fixtures)
from test_build_index_devices import TOPICS
from test_build_index_ray import SETTINGS, assert_same_index

from embedingest import build_index

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"), pytest.mark.slow]

RECORDS = [{"id": f"r{i}", "text": " ".join(TOPICS[i % 8:] + TOPICS[:i % 3]) + f" Part {i}."}
           for i in range(48)]
DRIVER = """
import json, sys
import ray
from embedingest import build_index_ray
address, out, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ray.init(address=address, log_to_driver=False, configure_logging=False)
records = json.load(sys.stdin)
build_index_ray(ray.data.from_items(records), out, concurrency=2, num_cpus=1, records_per_call=4,
                **settings)
"""


@pytest.fixture(scope="module")
def cluster(s3_endpoint, tmp_path_factory):
    """The nodes start in the environment a user's would hold: the store's endpoint and keys."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'embedingest[ray]')")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    env = pytest.MonkeyPatch()
    for key, value in s3_environment(s3_endpoint, tmp_path_factory.mktemp("home")).items():
        env.setenv(key, value)
    # Every node on this machine, at the address Ray gives it: Ray turns 127.0.0.1 into
    # the host's own address when a driver connects, so nodes bound to it are unreachable.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield ray, cluster
    ray.shutdown()
    cluster.shutdown()
    env.undo()


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "index"
    build_index(RECORDS, out=str(out), num_workers=0, **SETTINGS)
    return out


def ray_pids(s3, prefix) -> set[str]:
    """The actor processes that committed shards in the bucket (run ids end in _ray<pid>)."""
    try:
        names = [p.rsplit("/", 1)[-1] for p in s3.fs.ls(f"{s3.name}/{prefix}/shards", refresh=True)]
    except FileNotFoundError:
        return set()
    return {n.split("_ray")[1].split("_")[0] for n in names if "_ray" in n and n.endswith(".commit.json")}


def downloaded(s3, prefix, to):
    """The index in the bucket, as a local folder."""
    s3.fs.get(f"{s3.name}/{prefix}/", str(to), recursive=True)
    return to


@pytest.mark.timeout(1200)  # two builds, each with its own driver's start-up, on a loaded host
def test_a_worker_node_killed_mid_run_loses_nothing(tmp_path, cluster, single_process, s3):
    """Two nodes build the single-process index, even when one of them is killed mid-run
    and the build is run again (a clean two-node build is the same run without the kill,
    so one test covers both: each build's driver start-up costs a minute on two cores)."""
    from embedingest import build_index_ray
    from embedingest.index.remote_store import LEASE_NAME

    ray, cl = cluster
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    out = s3.url("killed")
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, cl.address, str(out), json.dumps(SETTINGS)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=os.environ)  # PYTHONPATH: the checkout (tests/conftest.py)
    driver.stdin.write(json.dumps(RECORDS))
    driver.stdin.close()
    try:
        deadline = time.monotonic() + 480  # a guard against a hang: start-up, hashing pass, plan
        while len(ray_pids(s3, "killed")) < 2:  # both actors at work, one per node (one CPU each)
            assert driver.poll() is None, driver.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the actors committed nothing in 480 s"
            time.sleep(0.2)
        assert driver.poll() is None  # mid-run
        cl.remove_node(next(iter(cl.worker_nodes)))  # its raylet, object store and actor, killed
        try:  # Ray Data may finish on the head alone, fail, or wait for a node
            driver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    finally:
        driver.kill()
        driver.wait()
    if s3.fs.exists(f"{s3.name}/killed/{LEASE_NAME}"):  # the killed driver's, as if it expired
        s3.put(f"killed/{LEASE_NAME}", json.dumps({"run": "killed", "host": "h", "pid": 1,
                                                   "expires": time.time() - 1}).encode())
    cl.add_node(num_cpus=1)
    cl.wait_for_nodes()
    summary = build_index_ray(ray.data.from_items(RECORDS), out, concurrency=2, num_cpus=1,
                              records_per_call=8, **SETTINGS)
    # Nothing lost: every record indexed once, the index (ids included) equal to a clean
    # build; the killed run's committed shards are kept (its unit rows were saved in the
    # bucket before the actors started, so the shards the poll above saw count).
    assert summary["units_incomplete"] == 0 and summary["index"] == out
    assert summary["units_indexed"] + summary["units_unchanged"] == len(RECORDS)
    assert summary["units_unchanged"] > 0
    assert_same_index(single_process, downloaded(s3, "killed", tmp_path / "killed"))
