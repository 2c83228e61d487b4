"""Runs rule strings through the real search-space loader under a memory and a time limit.

Run as a script by ``tests/test_rule_fuzz.py``: ``python _rule_fuzz_worker.py MEM_BYTES CPU_S CASE_S``
reads one JSON case per stdin line (``{"mode": "rule" | "python", "src": ...}``) and prints, for
each, ``{"start": i}`` before it runs and ``{"i": i, "outcome": ..., "detail": ...}`` after, flushed,
so a worker that dies still says which case killed it. With ``--fork-each`` every case runs in a
process of its own, forked after the imports, under its own limits: a case's leftovers (memory,
state) never reach the next, and the imports (0.7 CPU-s) are paid once. A case whose process dies
ends the worker with that process's status (128 + the signal), its result line missing.

Outcomes of a ``rule`` case: ``refused`` (a :class:`SpecError` naming ``search_space.rules[0]``),
``valid`` (the space loaded and every judgement of the rule returned None or a violation text), or
``error`` (anything else: MemoryError, the time limit, any other exception). A ``python`` case runs
``exec(src)`` as it is: the control that shows the limits are real.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import traceback


class _CaseTimeout(BaseException):  # BaseException: no `except Exception` in the code under test swallows it
    pass


def _alarm(signum, frame):  # noqa: ANN001 - signal handler signature
    raise _CaseTimeout()


_PARAMS = {"max_num_seqs": [8, 256], "max_num_batched_tokens": [2048, 8192], "kv_cache_dtype": ["auto", "fp8"],
           "enforce_eager": {"type": "bool"}, "gpu_memory_utilization": [0.9]}
_FLAG_SETS = (
    {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "kv_cache_dtype": "auto", "enforce_eager": False,
     "gpu_memory_utilization": 0.9},
    {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "kv_cache_dtype": "fp8", "enforce_eager": True,
     "gpu_memory_utilization": 0.9, "tensor_parallel_size": 2},
)
# Judged directly by Rule.violation: values a flag set could carry that no search space would offer.
_EXTREME_ENVS = (
    {"max_num_seqs": 0, "max_num_batched_tokens": -1, "kv_cache_dtype": "%0999999999d", "tensor_parallel_size": 0,
     "gpu_count": 0, "world_size": 0, "max_model_len": 0},
    {"max_num_seqs": 10**30, "max_num_batched_tokens": 1e308, "kv_cache_dtype": "x" * 64, "enforce_eager": True,
     "gpu_count": 2**62, "max_model_len": 10**18},
)


def _rule_case(src: str) -> tuple[str, str]:
    from servetune.errors import SpecError
    from servetune.spec.space import SearchSpace

    try:
        space = SearchSpace.from_dict({"params": _PARAMS, "rules": [src]})
    except SpecError as exc:
        if not exc.field.startswith("search_space.rules[0]"):
            return "error", f"SpecError names {exc.field!r}, not the rule"
        return "refused", str(exc)[:200]
    texts: list[str | None] = []
    for flags in _FLAG_SETS:
        out = space.check(flags, gpu_count=4)
        if not isinstance(out, list) or not all(isinstance(t, str) for t in out):
            return "error", f"check returned {out!r:.200}"
        texts += out
    for env in _EXTREME_ENVS:
        text = space.rules[0].violation(env)
        if text is not None and not isinstance(text, str):
            return "error", f"violation returned {text!r:.200}"
        if isinstance(text, str) and len(text) > 5000:
            return "error", f"violation text of {len(text)} characters"
        texts.append(text)
    return "valid", (next((t for t in texts if t), "") or "")[:200]


def _limit(mem: int, cpu: int) -> None:
    """Limit this process: ``mem`` bytes of address space beyond what it holds now, ``cpu`` seconds."""
    # The limit is on what a case may add to the address space the imports already hold (a
    # library may reserve far more address space than it uses): ``mem`` bytes beyond today's size.
    with open("/proc/self/status") as status:
        vm_size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + mem, vm_size + mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def _run_case(i: int, case: dict[str, str], case_s: float) -> None:
    """Run one case under a ``case_s`` alarm; print its result line."""
    signal.setitimer(signal.ITIMER_REAL, case_s)
    try:
        if case["mode"] == "python":
            exec(case["src"], {})  # noqa: S102 - the control case, written by the test itself
            outcome, detail = "valid", ""
        else:
            outcome, detail = _rule_case(case["src"])
    except _CaseTimeout:
        outcome, detail = "error", f"timeout after {case_s} s"
    except MemoryError:
        outcome, detail = "error", "MemoryError"
    except BaseException as exc:  # noqa: BLE001 - every other escape is what the fuzz test looks for
        outcome, detail = "error", "".join(traceback.format_exception_only(type(exc), exc)).strip()[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout.write(json.dumps({"i": i, "outcome": outcome, "detail": detail}) + "\n")
    sys.stdout.flush()


def _forked(i: int, case: dict[str, str], mem: int, cpu: int, case_s: float) -> int:
    """Run one case in a forked process under its own limits; its exit status (0: it printed its result)."""
    pid = os.fork()
    if pid == 0:  # the case's own process: limited, and gone once its result is printed
        code = 0
        try:
            _limit(mem, cpu)
            _run_case(i, case, case_s)
        except BaseException:  # noqa: BLE001 - a child never returns into the parent's loop
            code = 1
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell says


def main() -> int:
    mem, cpu, case_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    fork_each = sys.argv[4:] == ["--fork-each"]
    # Import before limiting memory: the limit is for the cases, not for Python's start-up.
    import servetune.spec.space  # noqa: F401

    if not fork_each:
        _limit(mem, cpu)
    signal.signal(signal.SIGALRM, _alarm)
    for i, line in enumerate(sys.stdin):
        case = json.loads(line)
        sys.stdout.write(json.dumps({"start": i}) + "\n")
        sys.stdout.flush()
        if not fork_each:
            _run_case(i, case, case_s)
        elif code := _forked(i, case, mem, cpu, case_s):
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
