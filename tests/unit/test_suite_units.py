"""The suite's own units of work (tests/conftest.py): the tests that share an engine stay on one worker."""

from __future__ import annotations

from tests import conftest


def test_the_groups_are_marked_before_xdist_reads_the_markers() -> None:
    # xdist's worker-side pytest_collection_modifyitems appends each test's group (its xdist_group marker) to its
    # node id, which is what `--dist loadgroup` schedules by: a marker added after that changes nothing. Session 28:
    # a merge dropped this hook's tryfirst, and both workers started the session's vLLM and ran its tests.
    assert conftest.pytest_collection_modifyitems.pytest_impl["tryfirst"] is True  # type: ignore[attr-defined]
