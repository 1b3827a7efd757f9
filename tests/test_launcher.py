"""The launcher helpers: tests/launcher.py and its shell twin jobs/launcher.sh give the same
command lines for MPICH and Open MPI, refuse node shapes a launcher cannot make, and the Slurm
launch picks the srun --mpi type of mpi4py's MPI library, and sourcing the shell twin exports
Open MPI's OMPI_MCA_osc=^ucx unless set (no MPI job is started here)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parents[1]
SHELL = ROOT / "jobs" / "launcher.sh"
CASES = [(1, None), (2, None), (4, 2), (3, "2,1"), (6, 3), (5, "2,2,1"), (4, "1,3")]


def shell(snippet: str, **env) -> subprocess.CompletedProcess:
    script = f'set -euo pipefail; source "{SHELL}"; {snippet}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def shell_command(ranks, nodes, kind):
    proc = shell(f'mpidl_mpiexec {ranks} "{nodes or 1}" prog --opt; printf "%s\\n" "${{MPIDL_CMD[@]}}"',
                 MPIDL_MPI_FLAVOR=kind, MPIEXEC="/x/mpiexec")
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


@pytest.mark.parametrize("kind", [launcher.MPICH, launcher.OPENMPI])
@pytest.mark.parametrize("ranks,nodes", CASES, ids=[f"{r}-{n}" for r, n in CASES])
def test_python_and_shell_agree(kind, ranks, nodes):
    try:
        expected = launcher.mpiexec(ranks, ["prog", "--opt"], nodes, exe="/x/mpiexec", kind=kind)
    except ValueError:
        expected = None
    code, words, err = shell_command(ranks, nodes, kind)
    if expected is None:  # refused by both, with a message
        assert code != 0 and "launcher.sh:" in err, (code, words, err)
    else:
        assert code == 0, err
        assert words == expected


@pytest.mark.parametrize("ranks,nodes", CASES, ids=[f"{r}-{n}" for r, n in CASES])
def test_ulfm_under_open_mpi_adds_with_ft_in_both_helpers(monkeypatch, ranks, nodes):
    """MPIDL_FT=ulfm: ``--with-ft ulfm`` right after the mpiexec, the rest unchanged."""
    monkeypatch.setenv("MPIDL_FT", "ulfm")
    try:
        expected = launcher.mpiexec(ranks, ["prog", "--opt"], nodes, exe="/x/mpiexec", kind=launcher.OPENMPI)
    except ValueError:
        return  # a node shape Open MPI cannot make: refused as without ULFM (test above)
    code, words, err = shell_command(ranks, nodes, launcher.OPENMPI)
    assert code == 0, err
    assert words == expected
    at = expected.index("/x/mpiexec")
    assert expected[at + 1:at + 3] == ["--with-ft", "ulfm"]
    plain = launcher.mpiexec(ranks, ["prog", "--opt"], nodes, exe="/x/mpiexec", kind=launcher.OPENMPI, ft="")
    assert expected[:at + 1] + expected[at + 3:] == plain


@pytest.mark.parametrize("ft", ["ulfm", "yes"])
def test_ulfm_under_mpich_and_unknown_values_are_refused_by_both(monkeypatch, ft):
    monkeypatch.setenv("MPIDL_FT", ft)
    kinds = [launcher.MPICH] if ft == "ulfm" else [launcher.MPICH, launcher.OPENMPI]
    message = "no usable ULFM" if ft == "ulfm" else "must be ulfm or empty"
    for kind in kinds:
        with pytest.raises(ValueError, match=message):
            launcher.mpiexec(4, ["prog"], 2, exe="/x/mpiexec", kind=kind)
        code, words, err = shell_command(4, 2, kind)
        assert code == 2 and message in err and err.count("\n") == 1, (code, words, err)


def test_mpich_fakes_hosts_and_open_mpi_uses_the_override():
    mpich = launcher.mpiexec(3, ["p"], "2,1", exe="mpiexec", kind=launcher.MPICH)
    assert mpich == ["mpiexec", "-n", "3", "-hosts", "localhost:2,127.0.0.1:1", "-launcher", "fork", "p"]
    ompi = launcher.mpiexec(4, ["p"], 2, exe="mpiexec", kind=launcher.OPENMPI)
    assert ompi[:2] == ["env", "MPIDL_RANKS_PER_NODE=2"]
    assert ompi[2:7] == ["mpiexec", "-n", "4", "--oversubscribe", "--bind-to"]
    assert ("--allow-run-as-root" in ompi) == (os.geteuid() == 0)
    with pytest.raises(ValueError, match="cannot give"):
        launcher.mpiexec(4, ["p"], [1, 3], exe="mpiexec", kind=launcher.OPENMPI)
    with pytest.raises(ValueError, match="equal nodes"):
        launcher.mpiexec(5, ["p"], 2, exe="mpiexec", kind=launcher.MPICH)


def test_flavor_of_this_launcher_matches_the_library():
    """The mpiexec beside this interpreter is of the MPI that mpi4py loads (what run_all.sh
    checks before any stage)."""
    exe = launcher.default_mpiexec()
    if not launcher.available(exe):
        pytest.skip("no mpiexec here")
    lib = shell(f'mpidl_library_flavor "{sys.executable}"')
    assert lib.returncode == 0, lib.stderr
    env = {k: v for k, v in os.environ.items() if k != launcher.FLAVOR_ENV}
    proc = subprocess.run(["bash", "-c", f'source "{SHELL}"; mpidl_mpi_flavor "{exe}"'],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip() == lib.stdout.strip()
    launcher._flavor_of.cache_clear()
    assert launcher._flavor_of(exe) == lib.stdout.strip()


def test_slurm_launch_picks_the_pmi_of_the_library():
    lib = shell(f'mpidl_library_flavor "{sys.executable}"').stdout.strip()
    proc = shell('mpidl_slurm_launch --cpu-bind=cores -- prog; printf "%s\\n" "${MPIDL_CMD[@]}"',
                 PYTHON=sys.executable, LAUNCHER="srun")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["srun", "--mpi=" + {"mpich": "pmi2", "openmpi": "pmix"}[lib],
                                        "--cpu-bind=cores", "prog"]
    proc = shell('mpidl_slurm_launch -- prog; printf "%s\\n" "${MPIDL_CMD[@]}"', PYTHON=sys.executable,
                 LAUNCHER="mpiexec", MPIEXEC="mpiexec", SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4(x2)")
    assert proc.returncode == 0, proc.stderr
    placement = ["--map-by", "ppr:4:node"] if lib == "openmpi" else ["-ppn", "4"]
    words = proc.stdout.splitlines()
    assert words[:5] == ["mpiexec", "-n", "8", *placement] and words[-1] == "prog"
    assert shell("mpidl_slurm_launch -- prog", PYTHON=sys.executable, LAUNCHER="ssh").returncode != 0


def test_slurm_launch_defaults_to_hydra_under_mpich_and_srun_under_open_mpi():
    """Without LAUNCHER: MPICH's ranks are started by hydra inside the allocation (Slurm's pmi2
    plugin cuts MPICH's PMI-1 lines of more than 1024 bytes: tests/pmi1_probe.py), by the
    mpiexec beside $PYTHON; SRUN_MPI asks for srun with that type; Open MPI uses srun --mpi=pmix."""
    lib = shell(f'mpidl_library_flavor "{sys.executable}"').stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("LAUNCHER", "SRUN_MPI", "MPIEXEC")}

    def launch(**extra):
        proc = subprocess.run(
            ["bash", "-c", f'set -euo pipefail; source "{SHELL}"; mpidl_slurm_launch --cpu-bind=cores -- prog; '
                           'printf "%s\\n" "${MPIDL_CMD[@]}"'],
            capture_output=True, text=True, timeout=60,
            env={**env, "PYTHON": sys.executable, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)", **extra})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    if lib == "mpich":
        beside = Path(sys.executable).parent / "mpiexec"
        exe = str(beside) if os.access(beside, os.X_OK) else "mpiexec"
        assert launch() == [exe, "-n", "4", "-ppn", "2", "prog"]
        assert launch(SRUN_MPI="pmi2") == ["srun", "--mpi=pmi2", "--cpu-bind=cores", "prog"]
        assert launch(LAUNCHER="srun") == ["srun", "--mpi=pmi2", "--cpu-bind=cores", "prog"]
    else:
        assert launch() == ["srun", "--mpi=pmix", "--cpu-bind=cores", "prog"]


def test_run_tagged_gives_the_code_and_output_with_the_tag_and_one_thread():
    code = ("import os, sys; print(os.environ['OMP_NUM_THREADS'], bool(os.environ[sys.argv[1]])); "
            "sys.stderr.write('to stderr'); sys.exit(3)")
    returncode, output = launcher.run_tagged([sys.executable, "-c", code, launcher.TAG_ENV],
                                             dict(os.environ, OMP_NUM_THREADS="8"), timeout=60)
    assert returncode == 3 and output.startswith("1 True") and "to stderr" in output


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (no such process, or a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_run_tagged_past_its_timeout_kills_even_what_left_its_process_group(tmp_path):
    # The child starts a session of its own, so the kill of the process group misses it: only
    # the tag in its environment finds it.
    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            "open(sys.argv[1], 'w').write(str(p.pid)); print('started', flush=True); time.sleep(120)")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"(?s)did not end within 5 s:.*started"):
        launcher.run_tagged([sys.executable, "-c", code, str(pid_file)], timeout=5)
    assert time.monotonic() - start < 60  # not held until the escaped child's sleep of 120 s ends
    escaped = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(escaped) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(escaped)


@pytest.mark.parametrize("chosen", [None, "sm,rdma", ""])
def test_open_mpi_leaves_osc_ucx_out_unless_the_user_chose(chosen):
    """Sourcing jobs/launcher.sh (every job script that starts ranks does, and tests/run_all.sh)
    exports ``OMPI_MCA_osc=^ucx`` for the launches that follow, unless the user set the variable,
    even empty: Open MPI 5's osc/ucx otherwise prints an error for every window (issue 31 row 18).
    Importing mpidl used to set it; mpidl changes no environment now."""
    env = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_osc"}
    if chosen is not None:
        env["OMPI_MCA_osc"] = chosen
    proc = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SHELL}"; bash -c \'echo "[$OMPI_MCA_osc]"\''],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"[{'^ucx' if chosen is None else chosen}]", proc.stderr
