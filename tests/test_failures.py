"""Failures end the whole job promptly, name what broke, and leave nothing behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import forkserver

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

import tpviz
from tpviz.cli import main
from tpviz.events import LAUNCHER_RANK, Error, Phase, UnitStart, read_events_dir
from tpviz.models.demo import make_checkpoint
from tpviz.plan import resolve_plan
from tpviz.rankserver import start_server

from .conftest import REPO, run_cli

PROMPT = 30  # seconds: the generous liveness bound for "promptly"


def children() -> list[psutil.Process]:
    """Live child processes, except those multiprocessing starts once per process and that
    live until it exits, holding nothing of tpviz: the resource tracker, and the forkserver
    ranks are forked from (our direct child; ranks, its children, share its command line)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            command = " ".join(p.cmdline())
            server = "forkserver" in command and p.ppid() == os.getpid()
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in command:
                if not server:
                    out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def digest(directory) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


@pytest.fixture
def broken(tmp_path, tiny):
    """A copy of the tiny checkpoint, and its plan resolved while it was still whole."""
    out = tmp_path / "broken"
    shutil.copytree(tiny, out)
    return out, resolve_plan(out, 2)


def file_of(directory, name):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def rewrite_shard(directory, name, change) -> object:
    """Apply `change` to the tensors of the shard holding `name` and save it again (a test's
    own copy); returns the shard's path."""
    path = file_of(directory, name)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def expect_failure(source, plan, **kwargs) -> tpviz.LoadError:
    start = time.monotonic()
    with tpviz.launch(source, 2, plan, **kwargs) as job:
        with pytest.raises(tpviz.LoadError) as err:
            job.wait(PROMPT)
        assert job.state == "failed"
    assert time.monotonic() - start < PROMPT
    deadline = time.monotonic() + 5
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children() == []
    return err.value


@pytest.mark.slow
def test_a_forward_that_fails_on_one_rank_while_its_peers_wait_is_blamed_on_it(tmp_path):
    """A vocabulary of 4 over 3 ranks leaves rank 2 no embedding rows, and DTensor's embedding
    fails there while ranks 0 and 1 wait in its collective: the error is rank 2's failure,
    not rank 0 straggling."""
    dims = dict(layers=1, hidden=12, heads=3, kv_heads=3, vocab=4, intermediate=6)
    source = make_checkpoint(tmp_path / "ck", "tiny", **dims)
    with tpviz.launch(source, 3, heartbeat_timeout=5) as job:
        job.wait(PROMPT)
        with pytest.raises(tpviz.LoadError) as err:
            job.forward([1, 2])
        assert job.state == "failed"
    said = str(err.value)
    assert said.startswith("rank 2: forward failed in model.embed_tokens: RuntimeError: ")
    assert said.endswith(
        "(the other ranks wait in a collective it never reached; the job was ended)"
    )
    assert err.value.rank == 2 and children() == []


@pytest.mark.slow
def test_truncated_file_names_rank_module_and_file(broken):
    source, plan = broken
    name = "model.layers.1.mlp.up_proj.weight"
    path = file_of(source, name)
    path.write_bytes(path.read_bytes()[:-4096])
    before = digest(source)
    error = expect_failure(source, plan)
    text = str(error)
    assert "rank " in text and "truncated" in text and str(path) in text
    assert error.file == str(path) and error.module and error.module.startswith("model.layers.1")
    assert digest(source) == before


@pytest.mark.slow
def test_shape_mismatch_found_at_read_time(broken):
    source, plan = broken
    name = "model.layers.0.self_attn.k_proj.weight"
    path = rewrite_shard(source, name, lambda tensors: tensors.update({name: torch.zeros(32, 128)}))
    before = digest(source)
    error = expect_failure(source, plan)
    assert "model.layers.0.self_attn.k_proj" in str(error) and "[32, 128]" in str(error)
    assert error.module == "model.layers.0.self_attn.k_proj" and error.file == str(path)
    assert digest(source) == before


@pytest.mark.slow
def test_tensor_missing_at_read_time(broken):
    source, plan = broken
    name = "model.norm.weight"
    path = rewrite_shard(source, name, lambda tensors: tensors.pop(name))
    error = expect_failure(source, plan)
    assert name in str(error) and error.module == "model.norm"
    assert error.rank in (0, 1) and str(path.name) in str(error)


@pytest.mark.slow
def test_a_value_float16_cannot_hold_fails_the_cast_naming_the_tensor(broken):
    source, _ = broken
    name = "model.layers.1.mlp.down_proj.weight"

    def too_large_for_float16(tensors):
        assert tensors[name].dtype == torch.float32
        tensors[name][0, 0] = 1e6  # float16's largest is 65504: torch casts it to inf, silently

    rewrite_shard(source, name, too_large_for_float16)
    error = expect_failure(source, resolve_plan(source, 2, dtype="float16"), dtype="float16")
    assert f"{name}: inf after the cast from float32 to float16" in str(error)
    assert error.module == "model.layers.1.mlp.down_proj" and error.rank == 0


@pytest.mark.slow
def test_weights_that_compute_nan_are_blamed_for_it_not_the_plan(broken):
    source, plan = broken
    name = "model.norm.weight"
    rewrite_shard(source, name, lambda tensors: tensors[name].__setitem__(3, math.nan))
    with tpviz.launch(source, 2, plan, verify=True) as job:
        verify = job.wait(PROMPT).verify
    assert verify["ok"] is False and "max_abs_diff" not in verify  # not "nan is over tolerance"
    assert "logits are not finite (NaN or inf) in a single process too" in verify["error"]


@pytest.mark.slow
def test_rank_failing_in_rank0_broadcast_does_not_leave_peers_waiting(broken):
    source, plan = broken
    path = file_of(source, "model.layers.0.mlp.gate_proj.weight")
    path.write_bytes(path.read_bytes()[:100])
    error = expect_failure(source, plan, strategy="rank0_broadcast")
    assert error.rank == 0 and str(path) in str(error)


@pytest.mark.slow
def test_rank_killed_from_outside_fails_the_job_naming_it(small, tmp_path):
    killed = threading.Event()

    def kill_rank1(event):
        if isinstance(event, UnitStart) and event.rank == 1 and not killed.is_set():
            killed.set()
            os.kill(job._procs[1].pid, signal.SIGKILL)

    start = time.monotonic()
    # rank0_broadcast: rank 0 cannot finish its load without rank 1 (sliced ranks load apart,
    # and on a loaded machine rank 0 finished before the kill landed, writing its done)
    with tpviz.launch(small, 2, events_dir=tmp_path, strategy="rank0_broadcast") as job:
        job.subscribe(kill_rank1)
        with pytest.raises(tpviz.LoadError, match="rank 1 died") as err:
            job.wait(PROMPT)
    assert "SIGKILL" in str(err.value) and err.value.rank == 1
    assert time.monotonic() - start < PROMPT
    assert children() == []
    # neither rank wrote how the job ended (one was killed, the launcher ended the other):
    # the launcher ends both files, so that a follower of the dir sees the job fail
    ends = [ended_file(tmp_path, rank) for rank in (0, 1)]
    assert all(e.message == f"the job ended: {err.value}" for e in ends)
    assert ends[1].module == job.progress[1].module is not None  # where rank 1 was
    with pytest.raises(tpviz.LoadError, match="rank 1 died"):
        tpviz.LoadMonitor.from_events_dir(tmp_path).wait(PROMPT)


@pytest.mark.slow
def test_a_killed_rank_is_the_cause_even_when_its_server_reports_it_late(small):
    """A rank's exit is reported by the server that forked it, which may be slow to say so;
    the collective its death broke fails its peer at once, and that error must not be taken
    for the cause. Here the server is stopped for a second as rank 1 is killed."""
    server = forkserver._forkserver._forkserver_pid
    killed = threading.Event()

    def kill_rank1(event):
        if isinstance(event, UnitStart) and event.rank == 1 and not killed.is_set():
            killed.set()
            os.kill(server, signal.SIGSTOP)
            os.kill(job._procs[1].pid, signal.SIGKILL)
            threading.Timer(1.0, os.kill, (server, signal.SIGCONT)).start()

    with tpviz.launch(small, 2) as job:
        job.subscribe(kill_rank1)
        with pytest.raises(tpviz.LoadError, match=r"^rank 1 died \(SIGKILL"):
            job.wait(PROMPT)
    assert children() == []


def ended_file(events_dir, rank: int) -> Error:
    """The last event of a rank's events file, which must be an error."""
    last = [e for e in read_events_dir(events_dir) if e.rank == rank][-1]
    assert isinstance(last, Error)
    return last


PARENT = textwrap.dedent("""
    import sys, time, tpviz
    if __name__ == "__main__":
        job = tpviz.launch(sys.argv[1], 2)
        job.wait(120)
        programs = job.call("tests.helpers:start_program")
        print(" ".join(str(p) for p in [p.pid for p in job._procs] + programs), flush=True)
        time.sleep(600)
""")


@pytest.mark.slow
def test_killed_parent_takes_every_rank_and_what_they_started_with_it(tmp_path, tiny):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tiny)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # the ranks import tests.helpers
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # 2 ranks, 2 programs
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert_ended_soon(pids)
    finally:
        parent.kill()


def assert_ended_soon(pids: list[int]) -> None:
    deadline = time.monotonic() + PROMPT
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [_described(p) for p in pids if _alive(p)]
    assert not survivors, survivors


def _described(pid: int) -> str:
    """What a process that should have ended is doing, for the failure message."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            threads = [t.id for t in p.threads()]
            return f"{pid} {p.status()} ppid {p.ppid()} {p.cmdline()[:3]} threads {threads}"
    except psutil.Error as e:
        return f"{pid}: {e}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_cancel_and_timeout_end_every_rank(tiny, tmp_path):
    job = tpviz.launch(tiny, 2, events_dir=tmp_path)
    job.cancel()
    with pytest.raises(tpviz.LoadError, match="cancelled"):
        job.wait(PROMPT)
    assert job.state == "cancelled" and children() == []
    job.shutdown()
    # ranks cancelled before they began their files: the launcher writes how the job ended
    for rank in (0, 1):
        assert ended_file(tmp_path, rank).message == "the job ended: the load was cancelled"
    with pytest.raises(tpviz.LoadError, match="a failed job cannot reload"):
        job.reload()
    for rank in (0, 1):  # a refused reload changes nothing: the files still say why it ended
        assert ended_file(tmp_path, rank).message == "the job ended: the load was cancelled"
    with tpviz.launch(tiny, 2) as job:  # a finished load keeps its result
        result = job.wait(PROMPT)
        job.cancel()
        assert job.state == "closed" and job.wait() is result and children() == []
    with tpviz.launch(tiny, 2, timeout=0.001) as job:  # whole loads now fit in 0.5 s
        with pytest.raises(tpviz.LoadError, match="timeout"):
            job.wait(PROMPT)
    assert children() == []


@pytest.mark.slow
@pytest.mark.parametrize("end", ["timeout", "cancel", "unforked"])
def test_a_stopped_rank_server_cannot_keep_the_job_from_ending(tiny, end):
    """Forking a rank waits on the forkserver with no deadline of multiprocessing's: a stopped
    server holds neither the timeout, nor a cancel, nor the liveness bound. The job ends
    promptly and ends the server; the next launch starts a new one."""
    plan = resolve_plan(tiny, 2)
    start_server()
    server = forkserver._forkserver._forkserver_pid
    os.kill(server, signal.SIGSTOP)
    try:
        began = time.monotonic()
        job = tpviz.launch(
            tiny,
            2,
            plan,
            timeout=1.0 if end == "timeout" else None,
            heartbeat_timeout=1.0 if end == "unforked" else PROMPT,
        )
        if end == "cancel":
            job.cancel()
        expected = {
            "timeout": "timeout",
            "cancel": "cancelled",
            "unforked": r"not started: .* \(twice heartbeat_timeout, 1 s; a larger one allows",
        }
        with pytest.raises(tpviz.LoadError, match=expected[end]):
            job.wait(PROMPT)
        job.shutdown()
        assert time.monotonic() - began < PROMPT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGCONT)
    assert not psutil.pid_exists(server)  # ended and reaped
    assert children() == []
    with tpviz.launch(tiny, 2, plan) as job:
        assert job.wait(120)["plan_matches_shards"]


@pytest.mark.slow
def test_a_rank_server_stopped_after_forking_cannot_hold_the_shutdown(tiny):
    """A rank's exit is told by the server that forked it: one stopped after the ranks were
    forked could not say they had ended, and shutdown waited for it (until the interpreter's
    exit killed it, 40-50 s later). It is ended instead, and the next launch starts one."""
    job = tpviz.launch(tiny, 2)
    job.wait(120)
    server = forkserver._forkserver._forkserver_pid
    os.kill(server, signal.SIGSTOP)
    try:
        began = time.monotonic()
        job.shutdown()
        assert time.monotonic() - began < PROMPT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGCONT)
    assert not psutil.pid_exists(server) and children() == []
    with tpviz.launch(tiny, 2) as job:
        assert job.wait(120)["plan_matches_shards"]


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_twenty_launch_cancel_cycles_leave_nothing_behind(tiny):
    plan = resolve_plan(tiny, 2)
    with tpviz.launch(tiny, 2, plan) as job:  # warm: first-use imports and threads
        job.wait(120)
    threads, files = threading.active_count(), _open_files()
    for i in range(20):
        job = tpviz.launch(tiny, 2, plan)
        if i % 2:
            time.sleep(0.3)
        job.cancel()
        job.shutdown()
    assert children() == []
    assert threading.active_count() == threads
    assert _open_files() == files
    with tpviz.launch(tiny, 2, plan) as job:
        assert job.wait(120)["plan_matches_shards"]


@pytest.mark.slow
def test_ranks_listen_on_loopback_only(tiny):
    with tpviz.launch(tiny, 2) as job:
        job.wait(120)
        listening = []
        for proc in [psutil.Process(), *children()]:
            listening += [
                c.laddr.ip
                for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
        assert listening, "gloo should have listeners to check"
        assert set(listening) <= {"127.0.0.1", "::1"}
        # the forkserver the ranks came from has run no torch op: one thread, no OpenMP or
        # intra-op pool that a fork would copy half-alive
        server = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
        assert len(server) == 1 and server[0].num_threads() == 1


PROBE = """
import sys

import psutil

from tpviz.rankserver import rank_imports, start_server


def preloaded(name):
    print(name in sys.modules, flush=True)


if __name__ == "__main__":
    preload = rank_imports(sys.argv[1], "auto")
    ctx = start_server(preload)
    child = ctx.Process(target=preloaded, args=(preload[-1],))  # forked once preloading is done
    child.start()
    child.join()
    server = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
    print([s.num_threads() for s in server])
"""


@pytest.mark.slow
def test_a_transformers_model_is_preloaded_by_a_forkserver_that_stays_single_threaded(tmp_path):
    """Ranks of a transformers model fork with transformers and the model's modeling module
    already imported (seconds each rank would spend), from a server still one thread."""
    from .conftest import write_config

    source = write_config(tmp_path / "hf", model_type="mixtral")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(probe), str(source)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "[1]"]


def test_memory_forecast_refuses_what_cannot_fit_this_machine(tmp_path):
    from .conftest import write_config
    from .test_plan import LLAMA_70B

    source = write_config(tmp_path / "llama70b", **LLAMA_70B)  # 131 GiB of bf16 weights
    with pytest.raises(tpviz.launcher.MemoryForecastError) as err:
        tpviz.launch(source, 2, strategy="replicated", init="random")
    message = str(err.value)
    assert "replicated needs about" in message and "GiB is available" in message
    assert "--force" in message
    assert children() == []


UNGUARDED = textwrap.dedent("""
    import sys, tpviz
    job = tpviz.launch(sys.argv[1], 2)  # no `if __name__ == "__main__":`
    job.wait(120)
""")


@pytest.mark.slow
def test_a_script_without_the_main_guard_gets_the_message_alone(tmp_path, tiny):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    run = subprocess.run(
        [sys.executable, str(script), str(tiny)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 1
    assert "must guard the call with `if __name__ == '__main__':`" in run.stderr
    # the script's own short traceback, not one per rank from multiprocessing's bootstrap
    assert "spawn_main" not in run.stderr and "bootstrapping" not in run.stderr
    assert len(run.stderr.splitlines()) < 15, run.stderr


def test_a_program_read_from_stdin_is_told_to_run_from_a_file(tmp_path, tiny):
    # each rank imports __main__ from its file: `<stdin>` is none, and the ranks could not start
    guarded = "import sys, tpviz\nif __name__ == '__main__':\n    tpviz.launch(sys.argv[1], 2)\n"
    run = subprocess.run(
        [sys.executable, "-", str(tiny)],
        input=guarded,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == 1
    assert "this program was read from <stdin>, not from a file" in run.stderr
    assert "save the program to a file" in run.stderr
    assert os.listdir(tmp_path) == []  # no rank server was started, nothing left


@pytest.mark.slow
def test_a_rank_killed_while_running_a_command_says_so_and_what_sends_sigkill(tiny, tmp_path):
    """The kernel's out-of-memory killer ends a rank with SIGKILL, as `kill -9` does: the
    error says which command the rank was running when it died."""
    with tpviz.launch(tiny, 2) as job:
        job.wait(120)
        failed: list[BaseException] = []

        def call() -> None:
            try:
                job.call("tests.helpers:wait_for_go", str(tmp_path))
            except tpviz.LoadError as e:
                failed.append(e)

        calling = threading.Thread(target=call)
        calling.start()
        deadline = time.monotonic() + PROMPT
        while len(list(tmp_path.glob("started*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(job._procs[1].pid, signal.SIGKILL)
        calling.join(PROMPT)
    assert [str(e) for e in failed] == [
        "rank 1 died (SIGKILL, from outside the job: kill -9, or the kernel as memory ran "
        "out) while running call"
    ]
    assert children() == []


@pytest.mark.slow
def test_cancel_during_a_reload_and_a_rank_dying_between_loads(tiny):
    job = tpviz.launch(tiny, 2)
    job.wait(120)
    reloading = job.reload(strategy="replicated")
    reloading.cancel()
    with pytest.raises(tpviz.LoadError, match="cancelled"):
        reloading.wait(PROMPT)
    assert job.state == "closed" and reloading.state == "cancelled" and children() == []
    reloading.shutdown()

    job = tpviz.launch(tiny, 2)
    job.wait(120)
    os.kill(job._procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(tpviz.LoadError, match="rank 1 died") as err:
        job = job.reload(strategy="rank0_broadcast")  # raises here, or fails its wait
        job.wait(PROMPT)
    # the loaded job notices first ("after loading"), or the reload does ("between loads")
    assert "SIGKILL" in str(err.value)
    assert "after loading" in str(err.value) or "between loads" in str(err.value)
    assert time.monotonic() - start < PROMPT
    job.shutdown()
    assert children() == []

    job = tpviz.launch(tiny, 2)
    job.wait(120)
    programs = job.call("tests.helpers:start_program")
    os.kill(job._procs[1].pid, signal.SIGKILL)
    for _ in range(2):  # the command that meets the death, then one on the failed job
        with pytest.raises(tpviz.LoadError, match=r"rank 1 died \(SIGKILL"):
            job.forward([[1, 2, 3]])
    assert all(_alive(p) for p in programs)  # rank 1's is orphaned, rank 0's still its own
    job.shutdown()
    assert_ended_soon(programs)  # ended with the job: a dead rank's too

    job = tpviz.launch(tiny, 2)
    job.wait(120)
    programs = job.call("tests.helpers:start_program")
    job.shutdown()  # the ranks exit by themselves, leaving what they started
    assert_ended_soon(programs)


SWAPPED = {"layers.*.self_attn.q_proj": "rowwise", "layers.*.self_attn.o_proj": "colwise"}
# the default plan with o_proj colwise: DTensor's sharding propagation fails on fake tensors,
# which torch logs with a traceback of its own before raising
O_PROJ_COLWISE = {
    **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"layers.*.mlp.{p}": "colwise" for p in ("gate_proj", "up_proj")},
    "layers.*.mlp.down_proj": "rowwise",
    "embed_tokens": "embedding_rowwise",
    "lm_head": "colwise_gather_output",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "patterns, where", [(SWAPPED, "q_proj"), (O_PROJ_COLWISE, "o_proj")], ids=["swapped", "o_proj"]
)
def test_a_failed_verify_says_why_in_one_line_without_a_traceback(tiny, tmp_path, patterns, where):
    """A plan whose forward cannot run (attention's projections cut the wrong way round)
    loads as planned, then its verify fails: exit 1, one line on stderr, an error in the JSON.
    In a fresh process: the ranks' own stderr is the CLI's."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(patterns))
    done = run_cli(
        "load", str(tiny), "--world-size", "2", "--plan", str(plan), "--verify", "--json"
    )
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    # named where the styles break (the rowwise q_proj given the whole hidden state)
    failed = "tpviz load: verify failed: CommandFailed: rank 0: forward failed in "
    assert line.startswith(failed + f"model.layers.0.self_attn.{where}: RuntimeError: ")
    assert line.endswith("`tpviz plan --suggest` finds one that runs)")  # what to do
    result = json.loads(done.stdout)
    assert result["plan_matches_shards"] and result["verify"]["ok"] is False
    assert [e["code"] for e in result["errors"]] == ["VerifyFailed"]
    assert "\n" not in result["verify"]["error"]


@pytest.mark.slow
def test_a_verify_whose_model_fails_unsharded_too_blames_the_model_not_the_plan(tiny, capsys):
    model = "tests.helpers:llama_whose_attention_fails"
    assert main(["load", str(tiny), "--model", model, "--verify", "--json"]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == (
        "tpviz load: verify failed: LoadError: the model's forward fails in a single process "
        "too (in model.layers.0.self_attn): RuntimeError: torch.clamp: At least one of 'min' or "
        "'max' must not be None; its config or code is at fault, not the plan"
    )
    assert json.loads(out)["plan_matches_shards"] and children() == []


def exits(model, code):
    sys.exit(code)


@pytest.mark.slow
def test_a_rank_that_exits_is_named_with_its_exit(tiny):
    with tpviz.launch(tiny, 2) as job:
        job.wait(PROMPT)
        with pytest.raises(
            tpviz.LoadError, match=r"rank [01] failed: the rank called sys.exit\(3\)"
        ):
            job.call(exits, 3)
        assert job.state == "failed"


@pytest.mark.slow
def test_a_killed_rank_server_ends_the_job_naming_the_server_not_a_rank(tiny):
    """multiprocessing reports every rank of a killed forkserver as exited with code 255 while
    they run on: the job names the server, ends the ranks, and the next launch starts a new
    server."""
    plan = resolve_plan(tiny, 2)
    start_server()
    server = forkserver._forkserver._forkserver_pid
    failed = threading.Event()

    def on_event(event):
        if isinstance(event, Phase) and event.rank == LAUNCHER_RANK and event.name == "failed":
            failed.set()

    with tpviz.launch(tiny, 2, plan) as job:
        job.wait(120)  # loaded: the ranks wait for commands
        job.subscribe(on_event)
        os.kill(server, signal.SIGKILL)
        assert failed.wait(PROMPT)
        assert "rank server (the forkserver) ended while its ranks ran" in str(job.error)
    assert not psutil.pid_exists(server)  # reaped
    assert children() == []
    with tpviz.launch(tiny, 2, plan) as job:
        assert job.wait(120)["plan_matches_shards"]
