"""Fixtures shared by test files."""

import pytest


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """configs/smoke.yaml through the whole DAG, once a session: (its directory, wall seconds).
    test_workflow reads its outputs; test_kill9 takes it as the uninterrupted reference, so
    no test may change what is under its results/."""
    from test_workflow import run_smoke

    return run_smoke(tmp_path_factory.mktemp("smoke"))
