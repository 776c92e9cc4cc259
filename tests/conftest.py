"""Fixtures shared by test files, and the suite's order across pytest-xdist workers.

``make test`` runs the suite on every core (``pytest -n CORES --dist loadfile``): each test
file goes whole to one worker, so a module fixture (the SLURM cluster, a trained model) is built
once. The session's smoke run is shared by every worker through a lock in xdist's common temp
folder (pytest-xdist's recipe for a session fixture run once): the first worker to ask runs it,
the others wait and read its directory.
"""

import json
import os
import random
import sys
import traceback
from pathlib import Path

import pytest
from filelock import FileLock

# Files that take minutes go out first, so that the short ones fill the other worker meanwhile
# (xdist hands files out in collection order once its reordering is off, below): the SLURM test
# (mostly waiting on the cluster) and the smoke run on one worker each, then the heavier unit
# files, the many small ones last, where they even out the two workers' ends. test_kill9 asks for
# the smoke run only once its own runs are done, so it may start while the smoke run still goes.
SLOW_FIRST = ("test_slurm_cluster.py", "test_workflow.py", "test_modeling_projected.py", "test_kill9.py",
              "test_resources.py", "test_training.py", "test_sweeps.py", "test_reporting_replicates.py",
              "test_attention.py", "test_reporting_pdflatex.py", "test_reporting_outputs.py")


# tests/unit/ (quick, one file a module: `pytest tests/unit`) and tests/e2e/ (the workflow end to
# end, subprocesses, CLIs, training), both run by make test; the helpers lie here in tests/, and a
# test file may import another's helpers (the smoke run of e2e/test_workflow.py) from either folder.
HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE / "e2e", HERE / "unit"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# The benchmarks the tests run write no records (benchmarks/_host.py): those come from real runs.
os.environ["DIMATTN_BENCH_RECORD"] = "0"


def pytest_configure(config):
    # pytest-xdist (3.x) sorts --dist loadfile's files by their number of tests unless told not
    # to, which sent the two slowest files (5 and 18 tests) out among the last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    # Within a file, the smoke run's readers first: the run starts as the session does. Stable:
    # the order within each group is the file's.
    items.sort(key=lambda item: (rank.get(item.path.name, len(SLOW_FIRST)), item.path.name,
                                 "smoke_run" not in item.fixturenames))


@pytest.fixture(autouse=True)
def seeded_rngs():
    """Every test starts from the same global RNG state, whatever ran before it on its worker:
    an unseeded draw (torch.randn_like) is then the same data in every xdist order (a bf16
    tolerance test failed CI on one order). Only libraries already imported are seeded."""
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(0)


@pytest.fixture
def tier_dir(tmp_path):
    """A working directory of its own for a Snakemake call on the checkout's configs, laid out as
    the Makefile's tiers/<tier>/: the checkout's results/ may hold a run of either tier (make run,
    make figures), which refuses the other one."""
    for name in ("config.yaml", "configs", "reference", "published"):
        (tmp_path / name).symlink_to(HERE.parent / name)
    return tmp_path


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, worker_id):
    """configs/smoke.yaml through the whole DAG, once a session: (its directory, wall seconds).
    test_workflow reads its outputs; test_kill9 takes it as the uninterrupted reference, so
    no test may change what is under its results/."""
    from test_workflow import run_smoke

    if worker_id == "master":  # not under xdist
        return run_smoke(tmp_path_factory.mktemp("smoke"))
    shared = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of this run
    marker = shared / "smoke.json"
    with FileLock(str(shared / "smoke.lock")):
        if not marker.is_file():
            root = shared / "smoke"
            root.mkdir()
            try:
                work, wall = run_smoke(root)
                marker.write_text(json.dumps({"work": str(work), "wall": wall}))
            except BaseException:  # pytest.fail included: the waiting workers fail with the same text
                marker.write_text(json.dumps({"error": traceback.format_exc()[-20000:]}))
                raise
        result = json.loads(marker.read_text())
    if "error" in result:
        pytest.fail(f"the session's smoke run failed on another worker:\n{result['error']}")
    return Path(result["work"]), result["wall"]
