"""A real one-node Slurm cluster on this machine, for tests: munged + slurmctld + slurmd.

Everything lives under one directory (configuration, munge key and socket, state, logs), on
ports chosen free at start, so it neither reads nor disturbs a system-wide Slurm or munge.
The daemons run in the foreground as children of the test process and are stopped by
:meth:`LocalSlurm.stop`. Debian's ``slurm-wlm`` and ``munge`` are installed with apt when
missing (root only). Each reason the cluster cannot run here raises :class:`Unavailable`
with a one-line explanation, which the fixture turns into the skip reason.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.ports import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
PACKAGES = ("slurm-wlm", "munge")


class Unavailable(RuntimeError):
    """This machine cannot run the local cluster; the message says why (one line)."""


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no {path.name})"
    return " | ".join(text[-lines:]) or f"({path.name} is empty)"


def ensure_installed() -> None:
    """Install ``slurm-wlm`` and ``munge`` with apt if a binary is missing (announced by
    ``scripts/test.sh``; ``TST_NO_APT=1`` refuses it).

    Raises:
        Unavailable: ``TST_NO_APT=1``, not root, no apt-get, or the install failed (with apt's
            last line).
    """
    if not [b for b in BINARIES if shutil.which(b) is None]:
        return
    # one install at a time: the suite's two workers may both get here, and a second apt-get
    # would fail on dpkg's lock (and skip its tests); the second waits, then finds the binaries
    with open(os.path.join(tempfile.gettempdir(), "tst_megatron_slurm_install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _install()


def _install() -> None:
    """:func:`ensure_installed`'s install, under its lock."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if os.environ.get("TST_NO_APT") == "1":
        raise Unavailable(f"{', '.join(missing)} not installed and TST_NO_APT=1 (no apt-get)")
    if os.geteuid() != 0:
        raise Unavailable(
            f"{', '.join(missing)} not installed and not root (cannot apt-get install slurm-wlm munge)"
        )
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} not installed and there is no apt-get here")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0:  # maybe no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    still = [b for b in BINARIES if shutil.which(b) is None]
    if result.returncode != 0 or still:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"'{' '.join(cmd)}' failed (exit {result.returncode}): {last[0]}")


class LocalSlurm:
    """A one-node cluster (``cpus`` CPUs, no GPUs) rooted at ``root``.

    Use as ``cluster = LocalSlurm(tmp); cluster.start(); ...; cluster.stop()``; run clients
    with ``env=cluster.env()`` (it sets ``SLURM_CONF``).
    """

    def __init__(self, root: Path, *, cpus: int = 2):
        self.root, self.cpus = Path(root), cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: dict[str, subprocess.Popen] = {}

    # --- configuration ----------------------------------------------------------------------

    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        (self.root / "plugstack.conf").write_text("")
        r = self.root
        lines = [
            "ClusterName=tstlocal",
            f"SlurmctldHost={self.node}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also delays a requeued job's restart (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={self.logs}/slurmctld.log",
            f"SlurmdLogFile={self.logs}/slurmd.log",
            f"PlugStackConfig={r}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",  # no cgroup setup needed
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # start a requeued job without a 60 s wait
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmdParameters=config_overrides",  # trust the CPU count below, not the machine
            f"NodeName={self.node} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self, **extra: str) -> dict:
        """``os.environ`` plus ``SLURM_CONF`` (and ``extra``), for the Slurm clients."""
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    # --- daemons ----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list) -> None:
        out = open(self.logs / f"{name}.stdout", "w")
        self._procs[name] = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        time.sleep(0.5)
        if self._procs[name].poll() is not None:
            log = self.logs / (f"{name}.log" if name != "munged" else "munged.log")
            raise Unavailable(
                f"{name} exited at start (status {self._procs[name].returncode}): "
                f"{_tail(self.logs / f'{name}.stdout')} {_tail(log)}"
            )

    def start(self, timeout: float = 60.0) -> None:
        """Write the configuration, start munged, slurmctld and slurmd, wait for the node to be idle.

        Raises:
            Unavailable: not root, unresolvable host name, a daemon that exits at start, or a
                node that does not become idle within ``timeout`` seconds.
        """
        if os.geteuid() != 0:
            raise Unavailable("slurmd must run as root to start jobs, and this test is not root")
        try:
            socket.gethostbyname(self.node)
        except OSError as exc:
            raise Unavailable(
                f"host name {self.node!r} does not resolve ({exc}); the launcher rendezvouses on it"
            ) from exc
        ensure_installed()
        self._write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={self.logs / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        deadline, state = time.monotonic() + timeout, "?"
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise Unavailable(
                        f"{name} exited (status {proc.returncode}): {_tail(self.logs / f'{name}.log')}"
                    )
            state = self.run("sinfo", "-h", "-n", self.node, "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise Unavailable(
            f"node {self.node} is {state!r}, not idle, {timeout:.0f} s after start: "
            f"{_tail(self.logs / 'slurmd.log')}"
        )

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; returns its completed process."""
        return subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env(), check=check, timeout=timeout
        )

    def job_field(self, job_id: str, field: str) -> str:
        """One ``Key=value`` field of ``scontrol show job`` (e.g. ``JobState``, ``Restarts``)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        for item in out.split():
            if item.startswith(field + "="):
                return item.split("=", 1)[1]
        raise KeyError(f"{field} not in scontrol show job {job_id}: {out.strip()}")

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user=root", check=False)
            deadline = time.monotonic() + 30
            while (
                time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip()
            ):
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
