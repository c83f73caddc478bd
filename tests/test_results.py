"""The typed load result: its JSON is the load JSON contract, read back unchanged."""

from __future__ import annotations

import json

from tpviz.results import STARTUP_PHASES, LoadResult, RankResult, add_ratios, startup_phases


def rank_entry(rank: int, seconds: float = 1.0, rss: int = 100) -> dict:
    return {
        "rank": rank,
        "seconds": seconds,
        "load_seconds": seconds,
        "param_bytes": 10,
        "planned_bytes": 10,
        "peak_rss_bytes": rss,
        "rss_baseline_bytes": 5,
        "peak_tensor_bytes": 10,
        "forecast_peak_bytes": 10,
        "bytes_sent": 0,
        "bytes_received": 0,
        "forecast_bytes_sent": 0,
        "forecast_bytes_received": 0,
        "plan_matches_shards": True,
        "mismatches": [],
    }


def test_a_rank_entry_reads_back_to_the_same_json():
    entry = {**rank_entry(0), "output_errors": [{"path": "p", "message": "m"}]}
    typed = RankResult.from_dict(entry)
    assert json.dumps(typed.to_dict()) == json.dumps(entry)
    assert typed["param_bytes"] == typed.param_bytes == 10 and "profile" not in typed


def test_a_load_result_is_a_read_only_view_of_its_json():
    data = {
        "strategy": "sliced",
        "load_seconds": 1.0,
        "ranks": [rank_entry(0), rank_entry(1)],
        "verify": {"ok": True},
    }
    result = LoadResult.of(data)
    assert LoadResult.of(result) is result
    assert result == data and json.dumps(result.to_dict()) == json.dumps(data)
    assert result["ranks"][1]["rank"] == result.ranks[1].rank == 1
    assert result.get("device") is None and result.get("verify") == {"ok": True}


def test_startup_phases_end_when_the_last_rank_passed_them():
    marks = [(1.0, 3.0, 3.5, 4.0), (2.0, 2.5, None, 6.0)]
    phases = startup_phases(0.0, marks)
    assert list(phases) == list(STARTUP_PHASES)
    assert phases == {"process_start": 2.0, "imports": 1.0, "process_group": 0.5, "skeleton": 2.5}
    assert sum(phases.values()) == 6.0  # the startup: spawn to the last rank ready


def test_ratios_are_against_sliced():
    sliced = LoadResult.of({"strategy": "sliced", "load_seconds": 2.0, "ranks": [rank_entry(0)]})
    other = LoadResult.of(
        {"strategy": "replicated", "load_seconds": 4.0, "ranks": [rank_entry(0, 3.0, 300)]}
    )
    add_ratios([sliced, other])
    assert other["ratio_to_sliced"] == {"load_seconds": 2.0, "peak_rss_bytes": 3.0}
    assert other.ranks[0].ratio_to_sliced["seconds"] == 3.0


def test_verify_tolerates_rounding_only_in_16_bit_dtypes():
    from tpviz.models import logits_tolerance as tolerance

    # the Python API takes float64 too: it is held to float32's bound, not bfloat16's
    assert tolerance("float64", 0.5) == tolerance("float32", 0.5) == 1e-4
    assert tolerance("bfloat16", 0.5) == tolerance("float16", 1.0) == 5e-2
    # relative to the logits' scale past 1: one bfloat16 step at 20 is 0.125
    assert tolerance("bfloat16", 20.0) == 1.0 and tolerance("float32", 20.0) == 2e-3
