"""Module-by-module sharded loading in spawned process groups (CPU, gloo).

One loaded 2-rank job is shared by most assertions; other world sizes each load once.
"""

from __future__ import annotations

import collections
import importlib
import json
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import tpviz
from tpviz.events import Done, Memory, Phase, UnitDone, UnitStart
from tpviz.launcher import LoadJob
from tpviz.messages import Beat
from tpviz.models import FIXED_PROMPT
from tpviz.plan import resolve_plan
from tpviz.results import RSS_MARGIN_BYTES
from tpviz.strategies import STRATEGIES

pytestmark = pytest.mark.slow

RANK_KEYS = {
    "rank",
    "seconds",
    "param_bytes",
    "planned_bytes",
    "peak_rss_bytes",
    "peak_tensor_bytes",
    "forecast_peak_bytes",
    "bytes_sent",
    "bytes_received",
}


@pytest.fixture(scope="module")
def job2(tiny):
    job = tpviz.launch(tiny, 2, verify=True, timeout=120)
    job.wait(120)
    yield job
    job.shutdown()


def test_result_follows_the_load_json_contract(job2):
    r = job2.result
    for key in (
        "strategy",
        "world_size",
        "dtype",
        "startup_seconds",
        "load_seconds",
        "plan_matches_shards",
        "ranks",
        "verify",
    ):
        assert key in r
    assert r["strategy"] == "sliced" and r["world_size"] == 2 and r["dtype"] == "float32"
    assert r["startup_seconds"] > 0 and r["load_seconds"] > 0
    assert all(RANK_KEYS <= set(rank) for rank in r["ranks"])
    assert [rank["rank"] for rank in r["ranks"]] == [0, 1]


def test_startup_phases_name_each_phase_and_add_up_to_the_startup(job2):
    r = job2.result
    phases = r["startup_phases"]
    assert list(phases) == ["process_start", "imports", "process_group", "skeleton"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) == pytest.approx(r["startup_seconds"])
    # a rank is heard only after it started; its own imports may take no time at all (forked
    # from a server that imported torch; the launcher can hear it first with that phase passed)
    assert phases["process_start"] > 0


def test_result_is_typed_and_its_json_is_the_mapping(job2):
    result = job2.result
    assert result.ranks[0].param_bytes == result["ranks"][0]["param_bytes"]
    assert json.loads(json.dumps(result.to_dict())) == dict(result)
    assert list(result.to_dict())[:9] == [
        "strategy",
        "world_size",
        "dtype",
        "device",
        "init",
        "source",
        "startup_seconds",
        "startup_phases",
        "load_seconds",
    ]


def test_param_bytes_equal_the_plan_exactly(job2):
    plan = job2.plan
    for rank in job2.result["ranks"]:
        assert rank["param_bytes"] == rank["planned_bytes"] == plan.per_rank_bytes[rank["rank"]]
    assert job2.result["plan_matches_shards"]


def test_tensor_accounting_equals_the_forecast_and_stays_at_the_shard(job2):
    for rank in job2.result["ranks"]:
        # float32 on CPU: every block is read straight into its final tensor
        assert rank["peak_tensor_bytes"] == rank["forecast_peak_bytes"] == rank["param_bytes"]
        assert rank["bytes_sent"] == rank["bytes_received"] == 0


def test_logits_match_the_single_process_reference(job2):
    verify = job2.result["verify"]
    assert verify["ok"] and verify["max_abs_diff"] <= 1e-4 and verify["tolerance"] == 1e-4
    logits = job2.forward(torch.tensor(FIXED_PROMPT))
    assert logits.shape == (1, 8, 1000)
    assert torch.isfinite(logits).all()


def test_token_ids_outside_the_vocabulary_are_refused_before_the_ranks(job2):
    for ids, named in (([[5, 999999]], "999999"), ([[5, -1]], "-1"), ([[1000]], "1000")):
        with pytest.raises(ValueError, match=f"token id {named} .*vocabulary size 1000"):
            job2.forward(ids)
    with pytest.raises(ValueError, match="integers"):
        job2.forward(torch.tensor([[5.0, 7.0]]))
    assert job2.state == "loaded"
    assert job2.forward([[5, 999]]).shape == (1, 2, 1000)


def test_shard_report_shows_real_shards_as_planned(job2):
    report = job2.shard_report()
    assert len(report) == 2
    for rank, rows in enumerate(report):
        by_name = {row["name"]: row for row in rows}
        assert set(by_name) == {t.name for t in job2.plan.params}
        q = by_name["model.layers.0.self_attn.q_proj.weight"]
        assert q["shape"] == [64, 128] and q["placement"] == "shard(0)"
        assert by_name["model.layers.0.self_attn.o_proj.weight"]["placement"] == "shard(1)"
        assert by_name["model.norm.weight"]["placement"] == "replicate"
        assert all(row["matches"] and row["device"] == "cpu" for row in rows)
        assert sum(row["bytes"] for row in rows) == job2.plan.per_rank_bytes[rank]


def shard_as_held(model, name):
    """Runs on every rank: the local shard of `name`, a view of the rank's shard block."""
    from tpviz.models.adapter import local_of

    return [local_of(model.get_parameter(name))]


def shard_fingerprint(model, name):
    """Runs on every rank: the local shard of `name`, as held."""
    from tpviz.models.adapter import local_of

    return local_of(model.get_parameter(name)).clone()


def test_call_runs_on_every_rank_and_shards_hold_the_checkpoint_slices(job2, tiny):
    from safetensors.torch import load_file

    name = "model.layers.1.mlp.down_proj.weight"
    parts = job2.call(shard_fingerprint, name)
    assert len(parts) == 2
    full = {}
    for f in tiny.glob("*.safetensors"):
        full.update(load_file(f))
    assert torch.equal(torch.cat(parts, dim=1), full[name])
    by_path = job2.call("tests.test_load:shard_fingerprint", name)
    assert all(torch.equal(a, b) for a, b in zip(parts, by_path))


def fails_deep_down(model):
    raise RuntimeError("first line\nsecond line")


def allocates_more_than_there_is(model):
    import torch

    return torch.empty(2**50, dtype=torch.uint8)  # a pebibyte: refused by the allocator


def returns_what_cannot_be_sent(model):
    return lambda: None


def test_a_shard_a_call_returns_comes_back_alone_not_with_the_ranks_whole_block(job2):
    name = "model.layers.0.mlp.down_proj.weight"
    for (held,), fingerprint in zip(
        job2.call(shard_as_held, name), job2.call(shard_fingerprint, name)
    ):
        assert held.untyped_storage().nbytes() == held.numel() * held.element_size()
        assert torch.equal(held, fingerprint)


def test_a_failed_call_is_one_line_with_the_traceback_beside_it_and_the_job_lives_on(job2):
    with pytest.raises(tpviz.LoadError) as failed:
        job2.call(fails_deep_down)
    error = failed.value
    assert str(error) == "rank 0: call failed: RuntimeError: first line" and error.rank == 0
    assert "Traceback" in error.traceback and "fails_deep_down" in error.traceback
    with pytest.raises(tpviz.LoadError, match="its result cannot be sent back: .*pickle"):
        job2.call(returns_what_cannot_be_sent)
    with pytest.raises(ValueError, match=r"^call: its arguments cannot be sent to the ranks \("):
        job2.call(shard_fingerprint, lambda: None)  # refused before any rank got it
    with pytest.raises(tpviz.LoadError, match=r"call failed: RuntimeError: .*CPUAllocator") as oom:
        job2.call(allocates_more_than_there_is)
    assert str(oom.value).endswith(
        "(the rank ran out of memory: give it a smaller input, or load over more ranks)"
    )
    assert job2.state == "loaded" and len(job2.call(shard_fingerprint, "model.norm.weight")) == 2
    # what the ranks could not import by name is said before anything is sent
    for fn, words in [
        (lambda model: 1, ".<locals>.<lambda> cannot reach the ranks, which import a function"),
        ("tests.test_load", "'tests.test_load' is not an import path 'pkg.mod:fn'"),
        (123, "call: fn must be a function or 'pkg.mod:fn', not 123"),
    ]:
        with pytest.raises((ValueError, TypeError), match=re.escape(words)):
            job2.call(fn)
    assert job2.state == "loaded"


def test_verify_checks_the_model_unsharded_only_for_a_forward_that_failed_on_a_rank(
    tiny, monkeypatch
):
    """A sharded forward that failed on a rank is run again in one process, to blame the
    model rather than the plan if it fails there too; one that ended because the job did
    (cancelled, a rank dead) builds no whole copy of the model for a job that is gone."""
    from tpviz.errors import CommandFailed
    from tpviz.runtime import verify
    from tpviz.runtime.options import LoadOptions

    plan, options, built = resolve_plan(tiny, 2), LoadOptions(), []
    reference_logits = verify.reference_logits
    monkeypatch.setattr(
        verify, "reference_logits", lambda *a: built.append(a) or reference_logits(*a)
    )
    for error, builds in [
        (tpviz.LoadError("the load was cancelled"), 0),
        (CommandFailed("rank 0: forward failed: RuntimeError: x", 0), 1),
    ]:

        def forward(ids, error=error):
            raise error

        with pytest.raises(type(error)):
            verify.verify_forward(plan, options, verify.fixed_prompt(plan), forward)
        assert len(built) == builds
        built.clear()


def test_a_call_whose_arguments_the_ranks_cannot_import_fails_alone(job2, tmp_path, monkeypatch):
    """A function or class the ranks cannot import by name (a module the caller put on its
    path after the ranks started, as a notebook's own functions are) fails the call; the
    ranks stay loaded."""
    (tmp_path / "made_after_launch.py").write_text("def fn(model):\n    return 1\n")
    monkeypatch.syspath_prepend(tmp_path)
    made_after_launch = importlib.import_module("made_after_launch")
    with pytest.raises(tpviz.LoadError, match=r"^rank 0: call failed: the rank cannot read its"):
        job2.call(made_after_launch.fn)
    assert job2.state == "loaded" and len(job2.call(shard_fingerprint, "model.norm.weight")) == 2


def test_events_cover_phases_units_and_memory(job2):
    events = job2.events
    units = len(job2.plan.units())
    for rank in (0, 1):
        mine = [e for e in events if e.rank == rank]
        assert sum(isinstance(e, UnitStart) for e in mine) == units
        done = [e for e in mine if isinstance(e, UnitDone)]
        assert [e.index for e in done] == list(range(units))
        assert sum(e.bytes for e in done) == job2.plan.per_rank_bytes[rank] - 32  # inv_freq
        memory = [e for e in mine if isinstance(e, Memory)]
        assert len(memory) >= units  # a sample at every unit boundary, at least
        assert all(m.rss > 0 and m.tensor_bytes >= 0 for m in memory)
        assert any(m.rss_anon for m in memory)
        phases = [e.name for e in mine if isinstance(e, Phase)]
        assert phases[:4] == ["starting", "skeleton", "ready", "loading"]
        assert phases[-2:] == ["checking", "loaded"]
        assert sum(isinstance(e, Done) for e in mine) == 1
    assert all(e.v == 1 and e.t > 0 for e in events)


def test_subscribers_get_past_and_new_events(job2):
    seen = []
    unsubscribe = job2.subscribe(seen.append)
    assert len(seen) == len(job2.events)
    unsubscribe()


@pytest.mark.parametrize("world_size", [1, 4])
def test_tiny_at_other_world_sizes(tiny, world_size):
    with tpviz.launch(tiny, world_size, verify=True) as job:
        result = job.wait(180)
    assert result["verify"]["ok"] and result["verify"]["max_abs_diff"] <= 1e-4
    assert result["plan_matches_shards"]
    plan = resolve_plan(tiny, world_size)
    assert [r["param_bytes"] for r in result["ranks"]] == plan.per_rank_bytes


def test_bfloat16_logits_of_a_real_models_scale_verify_within_their_rounding(tmp_path):
    """Real models' logits reach 10-40, where one bfloat16 step is 0.06-0.25: verify's bound
    grows with the logits' scale (an absolute 5e-2 failed every such model)."""
    from safetensors.torch import load_file, save_file

    from tpviz.models.demo import make_checkpoint

    ck = make_checkpoint(tmp_path / "ck", "tiny", dtype="bfloat16")
    weights = ck / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = (tensors["lm_head.weight"].float() * 100).bfloat16()
    save_file(tensors, weights, metadata={"format": "pt"})
    with tpviz.launch(ck, 2, verify=True) as job:
        verify = job.wait(180).verify
    assert verify["ok"] and 5e-2 < verify["max_abs_diff"] < verify["tolerance"] / 4


def tied_storage(model):
    from tpviz.models.adapter import local_of

    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    return head is embed, local_of(head).data_ptr() == local_of(embed).data_ptr()


def test_uneven_world_size_3_with_tied_embeddings(uneven3):
    plan = resolve_plan(uneven3, 3)
    assert [r.shape[0] for r in plan.tensor("lm_head.weight").ranks] == [334, 334, 333]
    with tpviz.launch(uneven3, 3, plan, verify=True) as job:
        result = job.wait(180)
        assert job.call(tied_storage) == [(True, True)] * 3
    assert result["verify"]["ok"] and result["verify"]["max_abs_diff"] <= 1e-4
    assert result["plan_matches_shards"]
    assert [r["param_bytes"] for r in result["ranks"]] == plan.per_rank_bytes


def test_a_thousand_modules_do_not_flood_the_caller(checkpoints, monkeypatch):
    from tpviz.models.demo import make_checkpoint

    received = collections.Counter()  # batches and replies the pump took from the ranks
    handle = LoadJob._handle

    def counting(job, rank, message):
        received[id(job)] += not isinstance(message, Beat)  # heartbeats are not event traffic
        return handle(job, rank, message)

    monkeypatch.setattr(LoadJob, "_handle", counting)

    deep = make_checkpoint(
        checkpoints / "deep",
        "tiny",
        layers=111,
        hidden=32,
        heads=2,
        kv_heads=2,
        intermediate=32,
        vocab=64,
    )
    with tpviz.launch(deep, 2) as job:
        result = job.wait(180)
        units = len(job.plan.units())
        assert units >= 1000
        done = [e for e in job.events if isinstance(e, UnitDone)]
        assert len(done) == 2 * units  # nothing lost
        seconds = max(r["seconds"] for r in result["ranks"]) + result["startup_seconds"]
        # batched: at most ~20 messages a second per rank, plus phase changes
        messages = received[id(job)]
        assert messages <= 2 * (25 * seconds + 20), messages
        assert messages < len(job.events) / 10


def test_commands_before_loading_are_refused(tiny):
    with tpviz.launch(tiny, 2) as job:
        with pytest.raises(tpviz.LoadError, match="commands need a loaded model"):
            job.shard_report()
        job.wait(120)


# --- warm ranks: loads after the first run on the same processes ---------------------------


@pytest.fixture(scope="module")
def warm(tiny):
    """Ranks kept warm across tests: each test loads on them with `warm.job.reload(...)`."""
    box = SimpleNamespace(job=tpviz.launch(tiny, 2, timeout=120))
    box.job.wait(120)
    box.pids = [p.pid for p in box.job._procs]
    box.first = box.job.result
    yield box
    box.job.shutdown()


def all_shards(model):
    """Runs on every rank: every local tensor, as held."""
    from tpviz.models.adapter import local_of

    return {n: local_of(t).clone() for n, t in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_reload_gives_a_fresh_load_s_shards_and_memory_figures(warm, job2, strategy):
    fresh = job2.call(all_shards)  # job2: a fresh sliced load of the same checkpoint
    previous = warm.job
    warm.job = previous.reload(strategy=strategy)
    result = warm.job.wait(120)
    assert previous.state == "closed" and previous.result is not None
    assert [p.pid for p in warm.job._procs] == warm.pids  # no new processes
    assert result["strategy"] == strategy and result["plan_matches_shards"]
    assert 0 < result["startup_seconds"] < result["startup_seconds"] + result["load_seconds"]
    held = warm.job.call(all_shards)
    for rank in (0, 1):
        assert held[rank].keys() == fresh[rank].keys()
        assert all(torch.equal(held[rank][n], t) for n, t in fresh[rank].items())
    for rank, (now, first) in enumerate(zip(result.ranks, warm.first.ranks)):
        # released: the baseline is back at the first load's, within the stated margin
        assert abs(now.rss_baseline_bytes - first.rss_baseline_bytes) <= RSS_MARGIN_BYTES
        assert now.param_bytes == first.param_bytes == job2.plan.per_rank_bytes[rank]
        assert now.peak_tensor_bytes == now.forecast_peak_bytes
        assert now.peak_rss_bytes >= now.param_bytes // 2  # fresh pages again, not reused
    assert not [w for w in result["warnings"] if w["code"] == "rss_not_released"]


# after the test above: the forward raises the ranks' resident set for good
def test_what_a_forward_keeps_on_the_ranks_is_not_reported_as_an_unreleased_model(warm):
    warm.job.forward(torch.tensor(FIXED_PROMPT))  # the first imports torch._dynamo (~45 MiB)
    for _ in range(2):  # the first load after it is the reference of the second
        warm.job = warm.job.reload()
        result = warm.job.wait(120)
        assert not [w for w in result["warnings"] if w["code"] == "rss_not_released"]


def test_reload_in_bfloat16_reads_through_a_staging_buffer_of_one_slice(warm, tiny):
    with pytest.raises(ValueError, match="keeps the ranks' world_size"):
        warm.job.reload(world_size=3)
    with pytest.raises(ValueError, match="unknown strategy"):
        warm.job.reload(strategy="nope")
    assert warm.job.state == "loaded"  # bad input leaves the loaded job as it was
    plan = resolve_plan(tiny, 2, dtype="bfloat16")
    warm.job = warm.job.reload(strategy="sliced", dtype="bfloat16", verify=True)
    result = warm.job.wait(120)
    assert result["dtype"] == "bfloat16" and result["verify"]["ok"]
    assert result["verify"]["tolerance"] == 5e-2
    assert [p.pid for p in warm.job._procs] == warm.pids
    for rank in result["ranks"]:
        assert rank["param_bytes"] == plan.per_rank_bytes[rank["rank"]]
        assert rank["peak_tensor_bytes"] == rank["forecast_peak_bytes"]
        assert rank["param_bytes"] < rank["peak_tensor_bytes"]
        largest = max(t.source_nbytes(t.ranks[rank["rank"]].bytes // 2) for t in plan.params)
        assert rank["peak_tensor_bytes"] <= rank["param_bytes"] + largest


# after the test above: the job's arguments now include dtype="bfloat16"
def test_a_resolved_plan_given_to_reload_is_loaded_for_what_it_was_resolved(warm, tiny_tied):
    plan = resolve_plan(tiny_tied, 2)  # another checkpoint, float32: neither is inherited
    warm.job = warm.job.reload(plan=plan)
    result = warm.job.wait(120)
    assert result["source"] == str(tiny_tied.resolve()) and result["dtype"] == "float32"
    assert result["plan_matches_shards"]
    with pytest.raises(ValueError, match="resolved for dtype float32, not bfloat16"):
        warm.job.reload(plan=plan, dtype="bfloat16")  # what reload is told still counts


def test_a_resolved_plan_keeps_its_keys_when_a_reload_changes_the_dtype(warm, tiny):
    """Its keys (the caller's, or the model's default plan) are resolved again for the new
    dtype: not replaced by the default plan, and a default plan not taken for the caller's."""
    mlp_only = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    for patterns in (mlp_only, None):
        warm.job = warm.job.reload(plan=resolve_plan(tiny, 2, patterns), dtype=None)
        warm.job.wait(120)
        warm.job = warm.job.reload(dtype="bfloat16")
        result = warm.job.wait(120)
        expected = resolve_plan(tiny, 2, patterns, dtype="bfloat16")
        assert result["dtype"] == "bfloat16" and result["plan_matches_shards"]
        assert [r["param_bytes"] for r in result["ranks"]] == expected.per_rank_bytes
        assert warm.job.plan.given_patterns == patterns
        # no unmatched_pattern for keys of the default plan this model lacks
        assert [w["code"] for w in result["warnings"]] == [w.code for w in expected.warnings]


def test_a_resolved_plan_keeps_its_dtype_when_a_reload_resolves_its_keys_again(
    warm, tiny, tiny_tied
):
    """A reload that changes what a resolved plan was resolved for resolves its keys again
    with the rest of what it was resolved with: its dtype stays for the same checkpoint;
    another checkpoint loads in its own."""
    mlp_only = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    for changes, dtype in [
        ({"source": str(tiny)}, "bfloat16"),
        ({"plan": mlp_only}, "bfloat16"),
        ({"source": tiny_tied}, "float32"),
    ]:
        warm.job = warm.job.reload(plan=resolve_plan(tiny, 2, dtype="bfloat16"), dtype=None)
        warm.job.wait(120)
        warm.job = warm.job.reload(**changes)
        result = warm.job.wait(120)
        assert result["dtype"] == dtype and result["plan_matches_shards"], changes


def test_modules_a_reload_imports_are_not_reported_as_an_unreleased_model(warm, tiny, tmp_path):
    """A load of another model family imports its modules into the ranks (transformers' and
    Mixtral's, here about 60 MiB), which stay: that load is the reference of those after it,
    and it is not itself taken for one that kept the previous model."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf-mixtral"
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(hf)
    for source in (hf, tiny, tiny):
        warm.job = warm.job.reload(source=source)
        result = warm.job.wait(120)
        assert not [w for w in result["warnings"] if w["code"] == "rss_not_released"], source


def test_a_reload_waits_for_no_call_a_thread_still_runs_on_the_ranks(warm, tmp_path):
    """A reload while another thread's `call` runs is refused: that call's replies would come
    from the next model, and be taken for the next job's."""
    fresh = warm.job.call(all_shards)
    replies: list = []
    call = threading.Thread(
        target=lambda: replies.append(warm.job.call("tests.helpers:wait_for_go", str(tmp_path)))
    )
    call.start()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(tpviz.LoadError, match="a call is running: reload once it returns"):
        warm.job.reload(strategy="replicated")
    (tmp_path / "go").touch()
    call.join(60)
    assert replies == [["went", "went"]] and warm.job.state == "loaded"
    warm.job = warm.job.reload(strategy="replicated")
    assert warm.job.wait(120)["strategy"] == "replicated"
    assert [sorted(r) for r in warm.job.call(all_shards)] == [sorted(r) for r in fresh]


def test_durations_given_to_wait_and_shutdown_are_checked(job2):
    for bad in (None, "5", -1, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
            job2.shutdown(timeout=bad)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
        job2.wait("5")
    assert job2.state == "loaded" and job2.wait(0) is job2.result
