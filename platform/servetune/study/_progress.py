"""What the driver tells the person watching: one callback per event, called by the driver with the
event's facts; :class:`TerminalProgress` turns them into servetune's terminal lines.

:class:`StudyProgress` is the set of callbacks and says nothing (a study run from code, the nightly's
noise estimate); :class:`TerminalProgress` writes one status line (rewritten in place on a
terminal, at most every 5 s otherwise) and one line per note.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> TerminalProgress(out, total=4).status(StudyOutcome("s", trials_done=1, ok=1), running=2, force=True)
    >>> out.getvalue()
    'trials 1/4 | running 2 | ok 1 | preempting 0 | startup failed 0 | pruned 0 | other failed 0 | best -\\n'
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from servetune.study._outcome import StudyOutcome

if TYPE_CHECKING:
    from servetune.planner.comm import CommEnv
    from servetune.search.confirm import Choice
    from servetune.search.headroom import Edge, StudyHeadroom
    from servetune.search.warmstart import WarmStart
    from servetune.spec.schema import StudySpec


class StudyProgress:
    """The driver's events, each a callback with its facts; this one shows nothing."""

    def status(self, outcome: StudyOutcome, running: int, force: bool = False, waiting: int = 0) -> None:
        """The counts so far; ``waiting``: of the ``running`` trials, those not placed on GPUs yet."""

    def already_done(self, spec: StudySpec, trials_done: int) -> None:
        """A ``--resume`` with nothing left to do: no trial ran."""

    def started(self, spec: StudySpec, backend: str, recovered: int, reconciled: int, informed: Sequence[Any],
                warm: Sequence[WarmStart], baseline: dict[str, Any] | None) -> None:
        """The study, its starting points (informed, warm, baseline) and where it is recorded."""

    def reaped(self, processes: int) -> None:
        """Processes an earlier driver's local Ray left behind were stopped."""

    def ray_beside(self, address: str) -> None:
        """The study's local Ray was started beside the cluster ``ray start`` recorded on this machine."""

    def all_quarantined(self) -> None:
        """Every GPU slot is out of service: the study stops."""

    def waits_for_gpus(self, trial: int, gpus: int, gpu_type: str, wait_s: float) -> None:
        """A trial waits for GPUs that no live node has free (said once per study)."""

    def infra_rerun(self, line: str) -> None:
        """An infrastructure failure the pool re-runs on another slot."""

    def slot_quarantined(self, note: str) -> None:
        """A slot taken out of service after repeated infrastructure failures."""

    def api_cpu_factor(self, factor: float, trial: int, cpu_s: float | None) -> None:
        """The host's API-server CPU factor, measured on the first real trial."""

    def screen_margins(self, note: str) -> None:
        """The simulator screen starts with wider margins, and why (:attr:`~servetune.search.SimScreen.margin_note`)."""

    def planned_with(self, env: CommEnv) -> None:
        """The environment the real trials are planned with: servetune's launch variables and the GPU workers'
        FlashInfer, probed or assumed (:func:`servetune.planner.comm.trial_env`)."""

    def led(self, trial: int, repeats: int) -> None:
        """A leading trial measured its confirmation repeats on its own server start."""

    def gpus_quarantined(self, trial: int, gpus: Sequence[str]) -> None:
        """GPU memory did not come back after a trial."""

    def unconfirmed(self, time_limit_s: float) -> None:
        """``budget.time_limit_s`` was spent before the confirmation."""

    def confirming(self, top: Sequence[int], held: Sequence[int], repeats: int, measured: int) -> None:
        """The confirmation starts: the top trials, the ones compared at no cost, repeats each."""

    def repeat_lost(self, repeat: int, trial: int, cause: str | None) -> None:
        """A confirmation repeat the machine lost (not a sample)."""

    def confirmed(self, choice: Choice) -> None:
        """Each confirmed trial's figures and the winner on them."""

    def headroom(self, result: StudyHeadroom, seconds: float) -> None:
        """The winner's and the runner-up's headroom on the simulator."""

    def edge_window(self, edge: Edge) -> None:
        """The winner is measured at its predicted edge on the real engine."""

    def interrupted(self, stopped: int, kept: int) -> None:
        """SIGTERM / Ctrl-C: running trials stopped, finished ones kept."""

    def no_gpus(self, stopped: int, kept: int) -> None:
        """No live node takes a trial: running trials stopped, finished ones kept."""

    def closed(self, outcome: StudyOutcome) -> None:
        """The dispatch ended (finished, interrupted or failed): the last counts."""

    def mlflow_buffered(self, left: int, buffer_dir: Path | None) -> None:
        """MLflow writes left in the on-disk buffer at the end."""


class TerminalProgress(StudyProgress):
    """servetune's terminal lines: a status line and notes on ``out``, MLflow's buffer on stderr."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out, self.total, self.tty = out, total, out.isatty()
        self._last = 0.0

    def note(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()

    def status(self, outcome: StudyOutcome, running: int, force: bool = False, waiting: int = 0) -> None:
        now = time.monotonic()
        if not force and not self.tty and now - self._last < 5:
            return
        self._last = now
        o = outcome
        best = "-" if o.best_metrics is None else f"{o.best_metrics.get('output_throughput', 0):,.0f} tok/s (#{o.best_number})"
        line = (f"trials {o.trials_done}/{self.total} | running {running - waiting}"
                + (f" | waiting for GPUs {waiting}" if waiting else "")
                + f" | ok {o.ok} | preempting {o.preempting}"
                f" | startup failed {o.startup_failed} | pruned {o.pruned} | other failed {o.other_failed}"
                + (f" | infra failed {o.infra_failed}" if o.infra_failed else "")
                + f" | best {best}")
        self.out.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.out.flush()

    def already_done(self, spec: StudySpec, trials_done: int) -> None:
        self.out.write(f"servetune: study {spec.name!r} already holds its {trials_done} told trials "
                       f"(budget.trials {spec.budget.trials}) and their records; no trial ran "
                       "(raise --trials to run more)\n")

    def started(self, spec: StudySpec, backend: str, recovered: int, reconciled: int, informed: Sequence[Any],
                warm: Sequence[WarmStart], baseline: dict[str, Any] | None) -> None:
        note = self.note
        note(f"servetune: study {spec.name!r}: {spec.model_ref} on {spec.gpu.count} x {spec.gpu.type} "
             f"({backend} backend), {spec.budget.trials} trials, {spec.budget.parallel} at a time"
             + (f"; resumed, {recovered} interrupted trials re-queued" if recovered else "")
             + (f", {reconciled} told trials written to MLflow/dataset" if reconciled else ""))
        if informed:
            note("servetune: informed starts (highest utilization that starts, max_num_seqs under the "
                 f"preemption bound): {', '.join(str(p) for p in informed)}")
        for ws in warm:
            note(f"servetune: warm start from study {ws.study!r} ({ws.model}, vLLM {ws.vllm_version}, "
                 f"distance {ws.distance:.2f}, best {ws.objective:,.0f}): {ws.params}")
        if baseline:
            note(f"servetune: baseline trial (vLLM's defaults for the searched flags): {baseline}")
        note(f"servetune: MLflow {spec.tracking.mlflow_uri} (experiment {spec.tracking.experiment!r}), "
             f"Optuna {spec.storage.optuna_url}")

    def reaped(self, processes: int) -> None:
        self.note(f"servetune: stopped {processes} processes left by the earlier driver's local Ray")

    def ray_beside(self, address: str) -> None:
        self.note(f"servetune: started its own local Ray (127.0.0.1) beside the Ray cluster that `ray start` recorded "
                  f"on this machine ({address}); to run the trials there, set RAY_ADDRESS={address}")

    def all_quarantined(self) -> None:
        self.note("servetune: every GPU slot is quarantined; stopping the study")

    def waits_for_gpus(self, trial: int, gpus: int, gpu_type: str, wait_s: float) -> None:
        self.note(f"servetune: trial #{trial} waits for {gpus} {gpu_type} GPU(s) that "
                  f"no live Ray node has free; where no node has them at all, the study stops after "
                  f"budget.wait_for_gpus_s ({wait_s:g} s) unless one comes "
                  "(an autoscaler adding it)")

    def infra_rerun(self, line: str) -> None:
        self.note(f"servetune: infrastructure failure, re-run elsewhere when possible: {line}")

    def slot_quarantined(self, note: str) -> None:
        self.note(f"servetune: slot quarantined: {note}")

    def api_cpu_factor(self, factor: float, trial: int, cpu_s: float | None) -> None:
        self.note(f"servetune: this host's vLLM API server costs {factor:.2f}x "
                  f"the simulator's calibration (trial #{trial}: {cpu_s:.1f} "
                  "CPU-s over the window); the simulator screen runs with it")

    def screen_margins(self, note: str) -> None:
        self.note(f"servetune: {note}")

    def planned_with(self, env: CommEnv) -> None:
        fusion = ("charges vLLM 0.17+'s FlashInfer all-reduce fusion workspace where it runs (TP 2/4/8, SM 9.0/10.x)"
                  if env.flashinfer_fusion else "charges no FlashInfer all-reduce fusion workspace")
        self.note(f"servetune: the pre-screen {fusion}: {env.source}")

    def led(self, trial: int, repeats: int) -> None:
        self.note(f"servetune: trial #{trial} led the study: {repeats} confirmation "
                  "repeat(s) measured on its own server start")

    def gpus_quarantined(self, trial: int, gpus: Sequence[str]) -> None:
        self.note(f"servetune: GPU memory did not come back after trial #{trial}: "
                  f"GPUs {', '.join(gpus)} quarantined")

    def unconfirmed(self, time_limit_s: float) -> None:
        self.note(f"servetune: budget.time_limit_s ({time_limit_s:g} s) spent: "
                  "the top configurations are not confirmed (resume with --resume and a "
                  "larger time_limit_s to confirm them)")

    def confirming(self, top: Sequence[int], held: Sequence[int], repeats: int, measured: int) -> None:
        self.note(f"servetune: confirming the top {len(top)} configurations (trials "
                  f"{', '.join(f'#{n}' for n in top)}), {repeats} repeats each"
                  + (f" ({measured} measured on the trials' own starts)" if measured else "")
                  + (f"; compared with {', '.join(f'#{n}' for n in held)}, whose repeats "
                     "their own starts measured" if held else ""))

    def repeat_lost(self, repeat: int, trial: int, cause: str | None) -> None:
        self.note(f"servetune: repeat {repeat} of trial #{trial} lost to an infrastructure failure: {cause}")

    def confirmed(self, choice: Choice) -> None:
        for c in choice.ranked:
            ci = "" if not math.isfinite(c.half_width) else f" +- {c.half_width:,.0f} (95% CI)"
            self.note(f"servetune: confirmed trial #{c.trial_number}: {c.mean:,.0f}{ci} over {c.n} runs, "
                      f"feasible in {sum(c.feasible)}/{c.n}")
        if choice.winner is not None:
            self.note(f"servetune: winner on confirmed figures: trial #{choice.winner.trial_number}"
                      + ("" if choice.overlap is None else
                         "; the top two intervals overlap (the data do not separate them)" if choice.overlap
                         else "; the top two intervals do not overlap"))

    def headroom(self, result: StudyHeadroom, seconds: float) -> None:
        self.note(f"servetune: headroom of the winner and the runner-up: {result.winner.simulations} + "
                  f"{0 if result.runner_up is None else result.runner_up.simulations} simulations"
                  + (f", {len(result.checked)} flag sets checked at x{result.min_headroom:g}"
                     if result.min_headroom is not None else "")
                  + f" in {seconds:.1f} s")

    def edge_window(self, edge: Edge) -> None:
        assert edge.first_fail is not None
        self.note(f"servetune: measuring the winner at its predicted edge ({edge.axis} x{edge.first_fail:.2f}, "
                  f"{edge.criterion}) on the real engine")

    def interrupted(self, stopped: int, kept: int) -> None:
        self.note(f"\nservetune: interrupted; {stopped} running trials stopped, "
                  f"{kept} finished trials kept (resume with --resume)")

    def no_gpus(self, stopped: int, kept: int) -> None:
        self.note(f"servetune: no GPUs for the study; {stopped} running trials stopped, "
                  f"{kept} finished trials kept")

    def closed(self, outcome: StudyOutcome) -> None:
        self.status(outcome, 0, force=True)
        if self.tty:
            self.out.write("\n")

    def mlflow_buffered(self, left: int, buffer_dir: Path | None) -> None:
        print(f"servetune: MLflow unreachable; {left} buffered operations kept in {buffer_dir} "
              "(delivered by the next run of this study, e.g. --resume)", file=sys.stderr)
