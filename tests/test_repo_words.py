"""The repository speaks of the product: no work-process words, no path outside the repository.

Evidence is named by what it is (date, GPU, model, flags, fixture folder), never by the order in which
the machines that produced it were lent, nor by the team's tracker. This test reads every tracked file
(``git ls-files``) that is text and under 2 MB, fixture data included: the notes of plans, results and
calibration files (JSON), the YAML of specs and published runs, READMEs, CSV landscapes, and the raw
evidence itself. Every file's name is read too (``test_file_names_say_what_a_file_is``): nothing the word
rules below refuse, no old host tag (``plan_h13_l8b_prof.json``, ``l8b_h7_*``: a host is named by its key).

One exemption, for raw evidence: what vLLM, ``vllm bench``, the collectors, servetune's CLI and MLflow
printed on the GPU hosts, kept byte for byte under ``tests/fixtures`` (``RAW_EVIDENCE``: ``*.log`` and
``*.txt`` there: server and study logs, collect outputs, ``/metrics`` dumps, ``mlflow_runs.txt``,
``host_setup.txt``) names the host's own paths as it printed them (``/work/main/servetune-runs-l8b/...``,
``/root/stash``), so the path rule skips those files; the word rules read them like any file. Recorded
names of what ran (``l8b_h13_u09_s256_mbt8192`` in a summary or a plan) are no words the rules match.

A line fails on any of these (``WORD_RULES``, case-insensitive):

* ``ordinal session``: an ordinal (first ... twentieth, or 1st, 12th ...), optionally joined to a
  second ordinal ("the tenth and eleventh") or followed by a count ("first three"), then optionally
  "device", then "session(s)": "the twelfth session's host", "the first three sessions". A Ray session, a database
  or HTTP session, a process session (``start_new_session``) or a pytest fixture scope never follows
  an ordinal, so they pass.
* ``device session``: the words "device session(s)" in any form.
* ``session by session``: a narrative told in the team's working order.
* ``numbered host``: an ordinal from "fourth" up (optionally "... to ninth", or "H200", "GPU",
  "fresh" between) before "host(s)": "the sixteenth H200 host". "a second fresh host" and "the first
  host" are ordinary English and pass; from the fourth on, a host is named by its key instead: the
  date of its runs and a letter (``2026-12-04h``, ``_fidelity.SCALE_HOSTS``).
* ``ordinal possessive``: an ordinal from "fourth" up with "'s" ("the fourteenth's first window"),
  the same numbering by another name.
* ``tracker issue``: "issue 12" / "issues 12" (no ``#``): the team's tracker. A source is cited with
  its repository and a ``#``: "vLLM issue #51041", "ray-project/kuberay#4366"; "issue #N" fails
  unless a repository name (vLLM, LMCache, Ray, KubeRay, llm-d, or ``owner/name``) precedes it on the
  same line.
* ``path outside the repository``: ``/work/...`` anywhere (the developers' machines); ``/root/...``
  unless it is the GPU host's own layout that its command lines and recorded runs name
  (``/root/model``, ``/root/m8b``, ``/root/m14b``, ``/root/m24b``, ``/root/q3``, ``/root/l8``, ``/root/g2``, ``/root/mx16``, ``/root/go20``, ``/root/g3t``, ``/root/dsv2``, ``/root/awq8``, ``/root/ghtiny``, ``/root/nemh8b``, ``/root/q3next12``, ``/root/q35moe20``, ``/root/mx``, ``/root/prof/...``,
  ``/root/gpu/...``, ``/root/.pyenv/...``, ``/root/.cache/...``).

``ALLOWED`` lists files not cleaned yet (none today).
It can only shrink: the test fails too when a listed file is already clean, so the entry goes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 2_000_000
#: Raw evidence, as the GPU hosts printed it: exempt from the path rule only (module docstring).
RAW_EVIDENCE = re.compile(r"^tests/fixtures/.*\.(log|txt)$")
_PATH_RULE = "path outside the repository"
#: A host's old tag in a file name (``h7``, ``h13``: the order the hosts came); ``h100``/``h200`` pass.
_HOST_TAG = re.compile(r"(?<![0-9a-z])h\d{1,2}(?![0-9a-z])", re.I)

_ORD_LOW = "first|second|third"
_ORD_HIGH = ("fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|"
             r"sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+th")
_ORD = rf"{_ORD_LOW}|{_ORD_HIGH}|\d+(st|nd|rd)"
_REPO_NAME = r"(vLLM|LMCache|Ray|KubeRay|llm-d|[\w.-]+/[\w.-]+)"

WORD_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ordinal session", re.compile(
        rf"\b({_ORD})(\s*(,|and|to|or)\s+(the\s+)?({_ORD}))*(\s+(two|three|four|five|six))?"
        r"\s+(device\s+)?sessions?\b", re.I)),
    ("device session", re.compile(r"\bdevice[\s-]+sessions?\b", re.I)),
    ("session by session", re.compile(r"\bsession\s+by\s+session\b", re.I)),
    ("numbered host", re.compile(
        rf"\b({_ORD_HIGH})(\s+(to|and)\s+(the\s+)?({_ORD}))?(\s+(H200|H100|GPU|fresh))?\s+hosts?\b", re.I)),
    ("ordinal possessive", re.compile(rf"\b({_ORD_HIGH})'s\b", re.I)),
    ("tracker issue", re.compile(r"\bissues?\s+\d+", re.I)),
    (_PATH_RULE, re.compile(
        r"(?<![\w.~-])(/work/|/root/(?!(model|m8b|m14b|m24b|q3|l8|g2|go20|g3t|dsv2|awq8|ghtiny|nemh8b|q3next12|q35moe20|mx16|mx|prof|gpu|\.pyenv|\.cache)\b))")),
)
_SOURCE_ISSUE = re.compile(r"\bissues?\s+#\d+", re.I)
_REPO_BEFORE = re.compile(_REPO_NAME + r"\b[^.;]{0,30}$")

#: Files with such words left, to be cleaned where they are being rewritten. Only ever remove entries.
ALLOWED: frozenset[str] = frozenset()


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    return [p for p in out.stdout.decode().split("\0") if p]


def _read(rel: str) -> str | None:
    """The file's text, or None for binaries (gzip, Parquet, SQLite), big files and paths gone from the tree."""
    path = ROOT / rel
    if not path.is_file() or path.stat().st_size > MAX_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(text: str, raw: bool = False) -> list[tuple[int, str, str]]:
    """(line number, rule, matched text) for every work-process word or outside path in ``text``;
    ``raw`` (raw evidence, ``RAW_EVIDENCE``) skips the path rule."""
    found: list[tuple[int, str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        for rule, pattern in WORD_RULES:
            if not (raw and rule == _PATH_RULE):
                found += [(number, rule, m.group(0)) for m in pattern.finditer(line)]
        for m in _SOURCE_ISSUE.finditer(line):
            if not _REPO_BEFORE.search(line[:m.start()]):
                found.append((number, "tracker issue", m.group(0)))
    return found


def test_rules_catch_process_words_and_pass_product_words() -> None:
    bad = ["the twelfth session's host", "the third device session", "first three sessions' windows",
           "the tenth and eleventh sessions' hosts", "the sixth to the twelfth session's",
           "a device session", "the sixteenth H200 host", "the fourth to ninth hosts' 80 windows",
           "the fourteenth's ran", "see issue 19", "(issue 12 items 1, 5, 6)", "issue #19 says",
           "/work/shared/gpu/examples/server1.log", "cat /root/notes.txt", "session by session",
           "the 12th session", "the 16th H200 host"]
    good = ["start_new_session=True", "the Ray session's logs", "@pytest.fixture(scope=\"session\")",
            "sessions terminated, transactions rolled back", "a second fresh host", "the first host",
            "vLLM issue #51041 ('H20 (95 GiB)')", "ray-project/kuberay#4366", "LMCache issue #1739",
            "vLLM CI, issue #33297", "the 2026-12-04h H200 host", "model: /root/m8b", "/tmp/ray/session_latest",
            "/root/.cache/vllm/torch_compile_cache/", "the fourth calibration", "a third host's GEMMs"]
    assert [b for b in bad if not findings(b)] == []
    assert [(g, findings(g)) for g in good if findings(g)] == []
    # raw evidence keeps the GPU host's paths as printed, never the process words
    printed = "servetune: Optuna's, MLflow's and Ray's own messages are in /work/main/servetune-runs-l8b/logs/x.log"
    assert findings(printed) and not findings(printed, raw=True)
    # the exemption is the path rule's alone: every word example is still caught in raw evidence
    assert [b for b in bad if not b.startswith(("/", "cat ")) and not findings(b, raw=True)] == []
    assert RAW_EVIDENCE.match("tests/fixtures/real_h200/study_l8b/study_grid_1.log")
    assert not RAW_EVIDENCE.match("tests/fixtures/real_h200/scale/2026-12-04h_plan_l8b.json")
    assert not RAW_EVIDENCE.match("benchmarks/results/sim_heldout_h200.json")


def _name_findings(rel: str) -> list[str]:
    """What in a file's path names it by the work's order: an old host tag, or what a word rule refuses
    (a file citing a source's issue number, ``vllm_issue_12345.log``, is no tracker word here)."""
    words = rel.replace("_", " ").replace("-", " ")
    return [m.group(0) for m in _HOST_TAG.finditer(rel)] + [
        hit for _, rule, hit in findings(words) if rule not in ("tracker issue", _PATH_RULE)]


def test_file_names_say_what_a_file_is() -> None:
    assert _name_findings("benchmarks/real_vllm/plan_h13_l8b_prof.json") == ["h13"]
    assert _name_findings("tests/fixtures/real_h200/scale/l8b_h7_u09_s256_mbt8192/summary.json") == ["h7"]
    assert _name_findings("docs/twelfth_session_notes.md") and _name_findings("x/fifth-host/a.json")
    assert _name_findings("benchmarks/real_vllm/plan_2026_12_04e_l8b_prof.json") == []
    assert _name_findings("tests/fixtures/real_h200x2/h100_host_c/summary.json") == []
    assert _name_findings("tests/fixtures/vllm_issue_logs/issue_12345_oom.log") == []
    named = {rel: hits for rel in _tracked() if (hits := _name_findings(rel))}
    assert named == {}, "name files by date, GPU, model, flags (a host by its key), not by the order of the work"


def test_repository_speaks_of_the_product_only() -> None:
    dirty: dict[str, list[tuple[int, str, str]]] = {}
    for rel in _tracked():
        text = _read(rel)
        if text is not None and rel != "tests/test_repo_words.py":
            hits = findings(text, raw=bool(RAW_EVIDENCE.match(rel)))
            if hits:
                dirty[rel] = hits
    unexpected = {rel: hits[:5] for rel, hits in dirty.items() if rel not in ALLOWED}
    assert unexpected == {}, "work-process words or outside paths (name evidence by date, GPU, model, flags, folder)"
    clean_now = sorted(ALLOWED - set(dirty))
    assert clean_now == [], "these files are clean now: take them off ALLOWED"
