"""The launchers as users run them: a SIGTERM to `torchrun` itself, as schedulers send it, and
two `torchrun` launchers as two nodes (here on one machine: each node's rank has LOCAL_RANK 0,
so a local rank taken for the global one, or the reverse, shows; on CUDA each node sees a GPU of
its own, conftest.node_env). Every test here needs 2 processes: one a GPU on CUDA.

Each launch takes a minute or more on 2 cores (a vLLM engine per rank), so the tests share them: the
two-node launch resumes the checkpoint that the signalled run saved.

Run as a script (torchrun's entry point for the signal test), this file is grpo.py whose steps
take SLOW_STEP_S and checkpoints SLOW_SAVE_S longer: a step plus a checkpoint that outlast
torchrun's default 30 s between forwarding SIGTERM and SIGKILL, as a GPU step and a real
model's checkpoint do."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import common.interrupt
from common.interrupt import GracefulInterrupt
from tests.conftest import ROOT, pythonpath, TINY_MODEL, need_processes, node_env
from tests.test_dist import SMALL
from tests.test_grpo_e2e import read_metrics

SLOW_SAVE_S = 35
SLOW_STEP_S = 3
SHUTDOWN_TIMEOUT_S = 300  # the README's --shutdown-timeout, sized for this machine


def torchrun(flags: list, script_and_args: list, cwd, log: Path, **env) -> subprocess.Popen:
    """`torchrun FLAGS SCRIPT ARGS` started in cwd, its output (every rank's) into log: a file, not
    a pipe that nobody reads while the run goes on."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath(), "PID_DIR": str(log.parent), **env}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *map(str, flags),
                                 *map(str, script_and_args)], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def two_nodes(script_and_args: list, cwds: list, logs: list) -> list[subprocess.Popen]:
    """The README's multi-node command, once per "node", on this machine (a free port), each node
    on a GPU of its own on CUDA."""
    need_processes(2)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"localhost:{port}", "--rdzv-id", "test", "--shutdown-timeout", SHUTDOWN_TIMEOUT_S]
    return [torchrun(flags, script_and_args, cwd, log, **node_env(node))
            for node, (cwd, log) in enumerate(zip(cwds, logs))]


def finish(proc: subprocess.Popen, log: Path, timeout_s: int) -> str:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return log.read_text()


def wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int, timeout_s: int = 1800) -> None:
    deadline = time.time() + timeout_s
    while True:
        try:
            if read_metrics(run_dir)[-1]["step"] >= step:
                return
        except (OSError, IndexError, ValueError):  # not written yet, or a line half written
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "no progress"
        time.sleep(0.5)


def test_a_signal_repeated_within_seconds_is_the_same_request_and_a_later_one_aborts(monkeypatch):
    """SLURM signals every process of a job, and torchrun forwards the signal it got too: a rank
    gets it twice, which must not read as the second Ctrl-C that aborts without a checkpoint."""
    with GracefulInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs (two signals pending at once merge into one)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert interrupt.stop() and interrupt.exit_code == 143
        monkeypatch.setattr(common.interrupt, "SAME_REQUEST_S", 0.0)  # as if seconds had passed
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A long grpo run under `torchrun --nproc-per-node 2`, stopped during step 2 by a SIGTERM
    to torchrun and, as SLURM signals every process of a job, to rank 1 as well: rank 1 gets it
    twice, directly and from torchrun. (Two signals that arrive before the rank's Python handler
    runs merge into one; the test lets the handler run in between, as a rank busy in Python
    code does.)"""
    need_processes(2)
    tmp = tmp_path_factory.mktemp("stopped")
    out, log = tmp / "run", tmp / "torchrun.log"
    proc = torchrun(["--nproc-per-node", "2", "--shutdown-timeout", SHUTDOWN_TIMEOUT_S],
                    [Path(__file__).resolve(), "--steps", "1000", "--save-every", "0", "--model", TINY_MODEL,
                     "--output-dir", out, *SMALL], ROOT, log)
    wait_for_step(proc, out, log, 1)
    signalled_at = read_metrics(out)[-1]["step"]
    t0 = time.time()
    os.kill(int((tmp / "pid_1").read_text()), signal.SIGTERM)
    while "SIGTERM: finishing this step" not in log.read_text() and time.time() < t0 + 60:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # torchrun, which forwards it to both ranks
    output = finish(proc, log, SHUTDOWN_TIMEOUT_S + 300)
    return {"out": out, "returncode": proc.returncode, "output": output, "signalled_at": signalled_at,
            "exit_after_s": time.time() - t0}


@pytest.mark.slow
def test_a_sigterm_to_torchrun_lets_every_rank_finish_its_step_and_save_one_checkpoint(stopped):
    out, output = stopped["out"], stopped["output"]
    last = read_metrics(out)[-1]["step"]
    assert last >= stopped["signalled_at"] + 1, output[-3000:]  # the step under way was finished
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last}"], output[-3000:]
    assert sorted(os.listdir(out / "checkpoints" / f"step_{last}" / "optimizer")) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (out / "final").exists()
    # torchrun forwarded it to both ranks; rank 1's second copy was the same request, not "abort"
    assert "Sending process" in output and output.count("SIGTERM: finishing this step") == 2
    # it outlasted torchrun's default shutdown window, and --shutdown-timeout kept the ranks alive
    assert stopped["exit_after_s"] > 30 and "forcefully exiting" not in output
    # torchrun exits 1 whatever its workers' codes (143 here): the resume line says what to do
    assert stopped["returncode"] == 1
    assert f"--resume {out / 'checkpoints' / f'step_{last}'}" in output
    assert "torchrun will exit 1" in output


@pytest.fixture(scope="module")
def nodes(stopped, tmp_path_factory):
    """The stopped run resumed by two launchers of one process each (two "nodes", each in its own
    working folder, as on two machines) into a new run folder, 2 more steps, a checkpoint each."""
    tmp = tmp_path_factory.mktemp("nodes")
    checkpoint = next((stopped["out"] / "checkpoints").iterdir())
    last = int(checkpoint.name.removeprefix("step_"))
    cwds, logs = [tmp / "node0", tmp / "node1"], [tmp / "node0.log", tmp / "node1.log"]
    for cwd in cwds:
        cwd.mkdir()
    procs = two_nodes([ROOT / "grpo.py", "--resume", checkpoint, "--steps", last + 2, "--save-every", "1",
                       "--output-dir", tmp / "run"], cwds, logs)
    outputs = [finish(p, log, 1800) for p, log in zip(procs, logs)]
    return {"out": tmp / "run", "cwds": cwds, "last": last, "outputs": outputs,
            "returncodes": [p.returncode for p in procs]}


@pytest.mark.slow
def test_two_launchers_as_two_nodes_resume_the_stopped_run_and_save_every_rank_s_shard(nodes, stopped):
    out, last = nodes["out"], nodes["last"]
    assert nodes["returncodes"] == [0, 0], nodes["outputs"][0][-3000:] + nodes["outputs"][1][-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [last + 1, last + 2]
    assert all(m["rollout/logprob_mismatch"] < 1e-3 for m in metrics), metrics  # each node's engine synced
    assert json.loads((out / "args.json").read_text())["world_size"] == 2
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    for step in (last + 1, last + 2):
        checkpoint = out / "checkpoints" / f"step_{step}"
        assert json.loads((checkpoint / "run.json").read_text())["world_size"] == 2
        assert sorted(os.listdir(checkpoint / "optimizer")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (out / "final" / "model.safetensors").exists()
    # one run folder: nothing written where either node was started, the stopped run left as it was
    assert [os.listdir(cwd) for cwd in nodes["cwds"]] == [[], []]
    assert [p.name for p in (stopped["out"] / "checkpoints").iterdir()] == [f"step_{last}"]
    assert not (stopped["out"] / "final").exists()


@pytest.mark.slow
def test_a_rank_that_cannot_see_the_run_folder_fails_every_node_in_one_line(tmp_path):
    """Two nodes without a shared filesystem: /proc/self/cwd names each process's own working
    folder, so the same absolute --output-dir is a different folder on each "node", as a local
    disk's path is on two machines. (A relative --output-dir would not do: rank 0 resolves it and
    hands the absolute path to the others.)"""
    cwds, logs = [tmp_path / "a", tmp_path / "b"], [tmp_path / "a.log", tmp_path / "b.log"]
    for cwd in cwds:
        cwd.mkdir()
    t0 = time.time()
    procs = two_nodes([ROOT / "grpo.py", "--steps", "1", "--save-every", "1", "--model", TINY_MODEL,
                       "--output-dir", "/proc/self/cwd/run", *SMALL], cwds, logs)
    outputs = [finish(p, log, 600) for p, log in zip(procs, logs)]
    assert time.time() - t0 < 600, "a hang"
    line = f"error: rank 1 (on {socket.gethostname()}) cannot see the run folder /proc/self/cwd/run that rank 0"
    for proc, output in zip(procs, outputs):
        assert proc.returncode != 0 and line in output, output[-3000:]
        assert "put --output-dir on a filesystem that every node shares" in output
        assert not re.search(rf'File "{re.escape(str(ROOT))}/(common/|grpo\.py)', output), output[-3000:]
    # rank 0 (whichever launcher the rendezvous made it) made the folder and removed its marker; rank 1 wrote nothing
    assert sorted(os.listdir(cwd) for cwd in cwds) == [[], ["run"]]
    assert [os.listdir(cwd / "run") for cwd in cwds if (cwd / "run").exists()] == [[]]


if __name__ == "__main__":
    import grpo
    from common.args import cli
    from common.run import Run

    Path(os.environ["PID_DIR"], f"pid_{os.environ['RANK']}").write_text(str(os.getpid()))
    save_checkpoint = Run.save_checkpoint

    def slow_save_checkpoint(self, *args, **kwargs):
        time.sleep(SLOW_SAVE_S)
        return save_checkpoint(self, *args, **kwargs)

    Run.save_checkpoint = slow_save_checkpoint
    sync_weights = grpo.sync_weights

    def slow_sync_weights(*args):  # each step lasts seconds, as on a real model: the test's signal to torchrun
        time.sleep(SLOW_STEP_S)    # lands within the step rank 1 was signalled in, also on a loaded machine
        return sync_weights(*args)

    grpo.sync_weights = slow_sync_weights
    cli(grpo.main, grpo.Args)
