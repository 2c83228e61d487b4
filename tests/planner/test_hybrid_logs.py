"""The published starts of hybrid models (tests/fixtures/published_logs/hybrid.yaml) read as the index format says.

The planner does not plan Mamba / linear-attention hybrids yet (their configs are refused), so these starts are not
judged here. What is checked: the file parses with ``parse_index``; every start is a held-out ``hybrid`` start of
vLLM 0.10 or later with a named source; every model config it points to exists and says where it came from; and the
kept log lines read, with the product's own log parser, as the figures the entry records (a start whose source quotes
its figures without the log says so in the source entry).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from servetune.engines.vllm.logs import parse_log
from servetune.planner import memory
from servetune.planner.evidence import PublishedStart, parse_index

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "published_logs"
DOC: dict[str, Any] = yaml.safe_load((FIXTURES / "hybrid.yaml").read_text(encoding="utf-8"))
STARTS: list[PublishedStart] = parse_index(DOC)
FIELDS = {"weights": "weights_gib", "kv_cache": "available_kv_gib", "kv_tokens": "kv_cache_tokens",
          "max_concurrency": "max_concurrency"}


def _read(rel: str) -> str:
    """The kept lines of one start: untrusted text, read with a size cap."""
    with open(FIXTURES / rel, "rb") as fh:
        data = fh.read(1 << 20)
    assert len(data) < 1 << 20, rel
    return data.decode("utf-8", errors="replace")


def test_every_start_is_a_held_out_hybrid_of_vllm_0_10_or_later():
    assert len(STARTS) >= 5
    assert {s.kind for s in STARTS} == {"hybrid"}
    assert {s.role for s in STARTS} == {"held_out"}, "nothing is fitted on the hybrid starts"
    assert all(memory.parse_vllm_version(s.vllm) >= (0, 10, 0) for s in STARTS)
    assert any(s.failed for s in STARTS) and any(not s.failed for s in STARTS)


def test_every_source_has_an_address_and_says_what_it_is():
    used = {s.source for s in STARTS}
    assert used == set(DOC["sources"]), "a source no start uses, or a start without a source"
    for name in used:
        entry = DOC["sources"][name]
        assert entry["url"] and len(entry["what"]) > 80, name


@pytest.mark.parametrize("start", STARTS, ids=lambda s: s.id)
def test_the_model_config_exists_and_names_its_source(start: PublishedStart):
    cfg = json.loads((FIXTURES / start.model / "config.json").read_text(encoding="utf-8"))
    assert "_source" in cfg and len(cfg["_source"]) > 40
    text = cfg.get("text_config", cfg)
    assert int(text["num_hidden_layers"]) > 0 and int(text["num_attention_heads"]) > 0


def test_most_starts_keep_their_published_lines_and_the_rest_say_why():
    kept = [s for s in STARTS if s.log is not None]
    assert len(kept) >= 5
    for s in STARTS:
        if s.log is None:  # figures quoted by the source, not its log: the source entry says so
            assert "not the log itself" in DOC["sources"][s.source]["what"], s.id


@pytest.mark.parametrize("start", [s for s in STARTS if s.log is not None and not s.failed], ids=lambda s: s.id)
def test_kept_lines_read_as_the_logged_figures(start: PublishedStart):
    assert start.log is not None, start.id
    parsed = parse_log(_read(start.log))
    read = {k: getattr(parsed, a) for k, a in FIELDS.items() if getattr(parsed, a) is not None}
    assert read.keys() == FIELDS.keys(), (start.id, read)
    for key, value in read.items():
        assert float(start.logged[key]) == pytest.approx(float(value)), (start.id, key)


@pytest.mark.parametrize("start", [s for s in STARTS if s.failed], ids=lambda s: s.id)
def test_a_refused_start_keeps_the_refusal_with_its_figures(start: PublishedStart):
    assert start.log is not None, start.id
    found = re.search(r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\)", _read(start.log))
    assert found and start.logged["failure"] == "mamba_blocks", start.id
    assert (int(found.group(1)), int(found.group(2))) == (start.logged["max_num_seqs"], start.logged["mamba_blocks"])
