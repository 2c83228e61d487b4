"""``disable_custom_all_reduce``: a known vLLM flag end to end (registry, --set, resolution, argv, search
space, dataset column), as users copy it from their ``vllm serve`` command on TP layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.flags import FLAGS, parse_set_option, to_cli_args, to_command_line, validate_flags
from servetune.planner.gpus import get_gpu
from servetune.planner.modelinfo import load_model
from servetune.records.dataset import append_trials, read_trials, row_flags, trial_row
from servetune.result import TrialResult, TrialStatus
from servetune.spec.space import SearchSpace


def test_the_flag_is_a_bool_in_the_registry_with_vllms_spelling() -> None:
    spec = FLAGS["disable_custom_all_reduce"]
    assert spec.kind is bool and spec.cli == "--disable-custom-all-reduce"
    assert validate_flags({"disable_custom_all_reduce": True}) == {"disable_custom_all_reduce": True}
    with pytest.raises(SpecError) as err:
        validate_flags({"disable_custom_all_reduce": "yes"})
    assert err.value.field == "flags.disable_custom_all_reduce"


def test_set_option_and_argv_carry_it_both_ways() -> None:
    assert parse_set_option("disable-custom-all-reduce=true") == ("disable_custom_all_reduce", True)
    assert parse_set_option("disable_custom_all_reduce=false") == ("disable_custom_all_reduce", False)
    assert to_cli_args({"disable_custom_all_reduce": True}) == ["--disable-custom-all-reduce"]
    assert to_cli_args({"disable_custom_all_reduce": False}) == ["--no-disable-custom-all-reduce"]
    line = to_command_line("m/x", {"tensor_parallel_size": 2, "disable_custom_all_reduce": True})
    assert line == "vllm serve m/x --tensor-parallel-size 2 --disable-custom-all-reduce"


def test_resolution_defaults_to_false_and_round_trips_through_as_flags() -> None:
    model, gpu = load_model("llama-3.1-8b"), get_gpu("L40S")
    plain = resolve_engine_config({"tensor_parallel_size": 2}, model, gpu)
    assert plain.disable_custom_all_reduce is False
    assert "disable_custom_all_reduce" not in plain.as_flags()  # vLLM's default is not written out
    on = resolve_engine_config({"tensor_parallel_size": 2, "disable_custom_all_reduce": True}, model, gpu)
    assert on.disable_custom_all_reduce is True and on.as_flags()["disable_custom_all_reduce"] is True
    assert resolve_engine_config(on.as_flags(), model, gpu) == on
    # nothing else in the resolved engine moves with it
    assert dict(on.as_flags(), disable_custom_all_reduce=False) == dict(plain.as_flags(), disable_custom_all_reduce=False)


def test_a_search_space_may_search_or_condition_on_it() -> None:
    space = SearchSpace.from_dict({"params": {
        "disable_custom_all_reduce": {"type": "bool"},
        "max_num_seqs": {"type": "categorical", "choices": [64, 128], "when": {"disable_custom_all_reduce": True}}}})
    assert space.size() == 3  # off, or on with one of two max_num_seqs
    with pytest.raises(SpecError):
        SearchSpace.from_dict({"params": {"disable_custom_all_reduce": {"type": "categorical", "choices": ["on"]}}})


def test_the_dataset_keeps_it_as_a_typed_flag_column(tmp_path: Path) -> None:
    row = trial_row("s", 0, {"tensor_parallel_size": 2, "disable_custom_all_reduce": True},
                    TrialResult(TrialStatus.OK), gpu_type="L40S", model="m")
    assert row["flag_disable_custom_all_reduce"] is True
    append_trials(tmp_path, [row])
    df = read_trials(tmp_path)
    assert "flag_disable_custom_all_reduce" in df.columns
    assert row_flags(df.iloc[0].to_dict())["disable_custom_all_reduce"] is True
