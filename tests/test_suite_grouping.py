"""`make test` runs two pytest-xdist workers with `--dist loadgroup`: a module's tests, and all the
modules that read the shared default run, must each stay on one worker, or their fixtures (the
default run: minutes) are built on both. pytest 9.2 silently dropped xdist 3.8's group suffix from
node ids (pyproject.toml pins pytest below it); this test fails if the groups stop reaching xdist."""

from __future__ import annotations

import os

from conftest import SHARED_RUN_GROUP


def test_this_module_runs_as_one_group(request):
    marks = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert marks == ["test_suite_grouping"]
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("dist") == "loadgroup":
        assert request.node.nodeid.endswith("@test_suite_grouping"), request.node.nodeid


def test_modules_reading_the_default_run_share_one_group(request):
    session_items = request.session.items
    readers = {item.module.__name__ for item in session_items if SHARED_RUN_GROUP in item.fixturenames}
    for item in session_items:
        if item.module.__name__ in readers:
            assert [m.args[0] for m in item.iter_markers("xdist_group")] == [SHARED_RUN_GROUP], item.nodeid
