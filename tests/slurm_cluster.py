"""A real SLURM cluster on this machine for tests/test_slurm_real.py: munged, slurmctld and two
slurmd nodes (``slurmd -N n1``, ``-N n2``), each of one CPU at 127.0.0.1, every file of theirs
(key, config, state, spool, logs, sockets) in one directory.

    python -m tests.slurm_cluster DIR   # bring it up by hand; prints the SLURM_CONF to export

The daemons run as the current user (root here: SlurmUser=root) and are stopped by pid.
``cred_expire=5`` and ``sched_interval=2`` let a requeued job start again within seconds (SLURM
holds it back for cred_expire + 1 s, then its scheduling loop must come round); sacct reads
finished jobs' exit codes from jobcomp/filetxt with ``sacct --completion`` (no slurmdbd).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.distributed import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
INSTALL = "SLURM is not installed: apt-get install -y slurm-wlm munge (as root)"
NODES = ("n1", "n2")

CONF = """\
ClusterName=megatest
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock,cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
KillWait=5
MinJobAge=600
SlurmdTimeout=10
"""
NODE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN\n"
PARTITION = "PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP\n"


def _daemon(name: str) -> str | None:
    """Its path: on PATH, or in /usr/sbin where Debian puts the daemons (not on every PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def installed() -> bool:
    return all(_daemon(name) for name in DAEMONS)


@dataclass
class Cluster:
    """The running cluster: ``env`` holds SLURM_CONF for the client commands."""

    dir: Path
    env: dict[str, str]
    pids: list[int] = field(default_factory=list)  # munged, slurmctld
    nodes: dict[str, int] = field(default_factory=dict)  # slurmd's pid by node name

    def start_node(self, name: str) -> None:
        """``slurmd -N name``; SLURM returns a node that was down to service (ReturnToService=2)."""
        subprocess.run([_daemon("slurmd"), "-N", name], check=True, env=self.env, timeout=30)
        self.nodes[name] = _pid_from(self.dir / f"slurmd-{name}.pid")

    def lose_node(self, name: str) -> None:
        """The node crashes: its slurmd, the slurmstepd of every step on it and their processes
        die at once (SIGKILL). slurmctld marks it DOWN after SlurmdTimeout (10 s)."""
        slurmd = self.nodes.pop(name)
        (self.dir / f"slurmd-{name}.pid").unlink(missing_ok=True)
        tasks, stepds = [], set()
        for proc in Path("/proc").iterdir():
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
                parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
                parent_cmd = Path(f"/proc/{parent}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            in_job = any(var.startswith(b"SLURM_JOB_ID=") for var in environ)
            if in_job and f"SLURMD_NODENAME={name}".encode() in environ:
                tasks.append(int(proc.name))
                if parent_cmd.startswith(b"slurmstepd"):
                    stepds.add(int(parent))
        for pid in [slurmd, *stepds, *tasks]:
            _signal(pid, signal.SIGKILL)

    def run(self, *args: str, check: bool = True) -> str:
        """A client command (squeue, scontrol, sacct, ...) against this cluster: its stdout."""
        out = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: rc {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
        fields = {}
        for item in self.run("scontrol", "show", "job", "-o", job_id).split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def log(self, name: str) -> str:
        path = self.dir / "log" / name
        return path.read_text() if path.exists() else ""

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle."""
        deadline = time.monotonic() + timeout
        while self.run("sinfo", "-h", "-o", "%t", check=False).split() != ["idle"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout:.0f} s:\n{self.run('sinfo')}")
            time.sleep(0.5)

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job still queued or running, and wait until SLURM lists none."""
        jobs = self.run("squeue", "-h", "-o", "%A", check=False).split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-o", "%A", check=False).split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)

    def stop(self) -> None:
        """Every daemon this cluster started, by pid: SIGTERM, then SIGKILL after 10 s."""
        pids = [*self.nodes.values(), *reversed(self.pids)]
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            _signal(pid, signal.SIGKILL)
        self.pids.clear()
        self.nodes.clear()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon is not our child (it forked away): a zombie of ours would still answer.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _pid_from(path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().split()[0])
        time.sleep(0.1)
    raise RuntimeError(f"no pid in {path} after {timeout:.0f} s")


def start(root: Path) -> Cluster:
    """munged, slurmctld and the nodes ``NODES`` from a slurm.conf written into ``root``; returns
    once every node is idle. Stops what it started if that fails."""
    root = root.resolve()
    for sub in ("state", "log", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    user = pwd.getpwuid(os.getuid()).pw_name
    conf = CONF.format(host=host, user=user, ctld_port=free_port(), dir=root)
    for name in NODES:
        conf += NODE.format(name=name, host=host, port=free_port())
    conf += PARTITION.format(nodes=",".join(NODES))
    (root / "slurm.conf").write_text(conf)
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    cluster = Cluster(root, env)
    try:
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            [_daemon("munged"), f"--key-file={key}", f"--socket={root}/munge.sock",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log",
             f"--seed-file={root}/munged.seed", "--force"],
            check=True, env=env, timeout=30,
        )  # fmt: skip
        cluster.pids.append(_pid_from(root / "munged.pid"))
        subprocess.run([_daemon("slurmctld"), "-i"], check=True, env=env, timeout=30)
        cluster.pids.append(_pid_from(root / "slurmctld.pid"))
        for name in NODES:
            cluster.start_node(name)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session", name="slurm")
def slurm_fixture(tmp_path_factory) -> Iterator[Cluster]:
    """The cluster for this test session (a skip where SLURM is not installed): every job
    cancelled and every daemon stopped when the session ends."""
    if not installed():
        pytest.skip(INSTALL)
    cluster = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.stop()


if __name__ == "__main__":
    if not installed():
        sys.exit(INSTALL)
    up = start(Path(sys.argv[1] if len(sys.argv) > 1 else "slurm-test"))
    pids = " ".join(map(str, [*up.pids, *up.nodes.values()]))
    print(f"export SLURM_CONF={up.dir}/slurm.conf  # daemons: {pids}")
