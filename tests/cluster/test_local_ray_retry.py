"""A local Ray whose raylet Ray gave up on is started again, and the first attempt's processes end.

Ray 2.60 waits 30 s for a new node's raylet to register with its GCS (a constant of
``ray/_private/node.py``) and then raises "The current node timed out during startup", leaving the
GCS, the raylet and the reaper it started running; on 2 loaded cores that happened to a ``ray start``
in CI. The fault is injected into a real Ray: the first ``Node`` comes up whole and then raises
that error, as a late raylet would leave it; :func:`start_local_ray` must end those processes and bring
up a second node that runs a task.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, os, ray, ray._private.node as node_mod
from servetune.cluster import _ray_session
calls, first = [], []
original = node_mod.Node.__init__
def late(self, *args, **kwargs):
    original(self, *args, **kwargs)
    calls.append(1)
    if len(calls) == 1:
        first.extend(sorted(_ray_session._descendants(os.getpid())))
        raise Exception(_ray_session.RAYLET_LATE + ". This could happen because ...")
node_mod.Node.__init__ = late
_ray_session.start_local_ray(num_cpus=1, num_gpus=0, log_to_driver=False)
value = ray.get(ray.remote(lambda: 41 + 1).remote())
alive = [p for p in first if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
print(json.dumps({"nodes": len(calls), "value": value, "first": first, "alive": alive}))
ray.shutdown()
"""


def test_a_raylet_ray_gave_up_on_is_started_again_and_its_processes_are_ended() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="st-lr-", dir="/tmp"))  # short: Ray's socket paths have a limit
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               PYTHONPATH=str(REPO / "platform"))
    try:
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["nodes"] == 2 and got["value"] == 42
    assert got["first"], "the first attempt started no process"
    assert got["alive"] == [], got
