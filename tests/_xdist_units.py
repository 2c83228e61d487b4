"""The suite's ``--dist loadfile`` scheduler: whole files (or :data:`SERIAL_GROUPS` groups) per worker,
the groups first, and a worker that crashes costs its one test, not the run.

pytest-xdist 3.8.0's file scheduling hangs for ever after a worker dies (pytest-dev/pytest-xdist#784,
#1323, #1327): it puts the dead worker's whole workload back on the queue, its finished tests and the
test it died in included, and a worker handed a single test waits for a second one (or its shutdown)
before running it. :class:`FileOrGroupScheduling` reports the test the worker died in as failed once
(xdist's ``handle_crashitem``), queues only what is left to run, and never leaves a worker holding one
test with nothing to follow it; the replacement worker runs the rest and the run ends with every other
test's verdict.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

__all__ = ["SERIAL_GROUPS", "FileOrGroupScheduling", "work_unit"]

#: Test files that must not overlap one another on several workers: each brings up a Ray cluster of
#: several ``ray start`` nodes (3-4 raylets, a GCS, a dashboard, agents) or a whole local stack;
#: two of them at once on 2 cores push node start-ups past their deadlines. Under ``--dist loadfile``
#: the files of one group are one unit of work, run in turn on one worker.
SERIAL_GROUPS: dict[str, str] = {
    "tests/cluster/test_multinode.py": "ray-cluster",
    "tests/cluster/test_node_loss.py": "ray-cluster",
    "tests/cluster/test_readme_job.py": "ray-cluster",
    "tests/infra/test_local_stack.py": "ray-cluster",
}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under ``--dist loadfile``: its file, or its file's
    :data:`SERIAL_GROUPS` group.

    >>> work_unit("tests/test_study.py::test_grid[a::b]"), work_unit("tests/cluster/test_node_loss.py::test_x")
    ('tests/test_study.py', 'ray-cluster')
    """
    path = nodeid.split("::", 1)[0]
    return SERIAL_GROUPS.get(path, path)


class FileOrGroupScheduling(LoadFileScheduling):
    """``--dist loadfile`` over :func:`work_unit`, surviving a crashed worker (see the module docstring)."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        # The groups first: each is the longest unit (~4 min on 2 cores), so the other worker
        # runs the rest meanwhile and no group is left to run alone at the end.
        for group in sorted(set(SERIAL_GROUPS.values()) & set(self.workqueue), reverse=True):
            self.workqueue.move_to_end(group, last=False)
        super()._assign_work_unit(node)
        # xdist's worker runs a test once it holds the next one or its shutdown: never leave it one test alone.
        if self._pending_of(self.assigned_work[node]) < 2 and self.workqueue:
            self._assign_work_unit(node)
        elif not self.workqueue and not node.shutting_down:
            node.shutdown()

    def remove_node(self, node: Any) -> str | None:
        """Forget ``node``; where it died with tests pending, return the one it died in (reported failed by
        xdist, not run again) and queue the rest of its units for the other workers."""
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        crashed = next(nodeid for unit in unfinished.values() for nodeid, done in unit.items() if not done)
        unfinished[self._split_scope(crashed)][crashed] = True
        self.workqueue.update({scope: unit for scope, unit in unfinished.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed
