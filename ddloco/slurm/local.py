"""A live one-node Slurm cluster on this machine, for `make slurm-check` and the tests.

Debian's ``slurm-wlm`` (slurmctld, slurmd, sbatch ...) and ``munge``; everything else lives in a
work directory: slurm.conf, the controller's state, munged's socket, logs. The node declares more
CPUs than it has (``SlurmdParameters=config_overrides``) so a services job, a learner array and
scavengers fit side by side. Partitions:

    services   PriorityTier 10 (default)   the services job
    learners   PriorityTier 10             learner arrays, and the "other users' jobs" of the check
    scavenge   PriorityTier 1, PreemptMode=REQUEUE: preempted (requeued) by jobs of the others

``LocalSlurm(work).start()`` needs root (slurmd starts jobs as their users); ``missing()`` says
what is not there, in one line, before anything starts.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from common.redis_server import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "munged")
MUNGE_KEY = Path("/etc/munge/munge.key")
NODE_CPUS = 16
PARTITIONS = (("services", 10, "YES", ""), ("learners", 10, "NO", ""), ("scavenge", 1, "NO", "PreemptMode=REQUEUE"))


def missing() -> str:
    """Why a local Slurm cannot run here ("" when it can)."""
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if absent:
        return (f"no {', '.join(absent)}: install Debian's slurm-wlm and munge (`apt-get install slurm-wlm munge`, "
                "as `make slurm-check` does as root)")
    if os.geteuid() != 0:
        return "a local slurmd must run as root (it starts jobs as their users)"
    if not MUNGE_KEY.exists():
        return f"no {MUNGE_KEY}: the munge package makes it on install"
    return ""


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """One slurmctld, one slurmd and a munged in ``work`` (started by ``start``, stopped by ``stop``)."""

    def __init__(self, work: Path, cpus: int = NODE_CPUS) -> None:
        self.work = work.resolve()
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.work / "slurm.conf"
        self.munge_dir = Path(tempfile.mkdtemp(prefix="ddloco-munge-"))
        """munged's socket and state: a directory of its own in the system's temporary one, since
        munged wants every directory above its socket traversable by everyone (a pytest tmp_path,
        say, is not)."""
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ configuration
    def _write_conf(self) -> None:
        w = self.work
        lines = [
            "ClusterName=ddloco", f"SlurmctldHost={self.host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_dir / 'munge.sock'}", "CredType=cred/munge",
            f"StateSaveLocation={w / 'state'}", f"SlurmdSpoolDir={w / 'spool'}",
            f"SlurmctldPidFile={w / 'slurmctld.pid'}", f"SlurmdPidFile={w / 'slurmd.pid'}",
            f"SlurmctldLogFile={w / 'slurmctld.log'}", f"SlurmdLogFile={w / 'slurmd.log'}",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2", "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            "JobRequeue=1", "ReturnToService=2", "SlurmdParameters=config_overrides", "KillWait=30",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={w / 'jobcomp.txt'}", "MinJobAge=600",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=16000 State=UNKNOWN",
        ]
        for name, tier, default, extra in PARTITIONS:
            lines.append(f"PartitionName={name} Nodes={self.host} PriorityTier={tier} Default={default} "
                         f"MaxTime=INFINITE State=UP {extra}".rstrip())
        self.conf.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        for sub in ("state", "spool"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            argv = [_which(daemon), "-f", str(self.conf)] + (["-i"] if daemon == "slurmctld" else [])
            subprocess.run(argv, env=self.env, check=True, timeout=30)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if p.returncode == 0 and p.stdout.strip() and all(s.strip() == "idle" for s in p.stdout.split()):
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the local Slurm did not come up in {timeout_s:.0f} s: see {self.work}/slurmctld.log, "
                           "slurmd.log")

    def _start_munge(self) -> None:
        d = self.munge_dir
        shutil.chown(d, "munge", "munge")
        os.chmod(d, 0o711)   # munged wants its socket directory reachable by every user
        subprocess.run(["su", "munge", "-s", "/bin/sh", "-c",
                        f"{_which('munged')} --socket={d / 'munge.sock'} --pid-file={d / 'munged.pid'} "
                        f"--seed-file={d / 'seed'} --log-file={d / 'munged.log'} --key-file={MUNGE_KEY}"],
                       check=True, timeout=30)

    def stop(self) -> None:
        """Cancel every job, stop slurmd, slurmctld and munged (each by its pid file)."""
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # the jobs' processes end (SIGTERM, then KillWait's SIGKILL)
            p = subprocess.run(["squeue", "-h", "-t", "running,completing"], env=self.env, capture_output=True,
                               text=True, timeout=30)
            if p.returncode != 0 or not p.stdout.strip():
                break
            time.sleep(0.5)
        for pid_file in (self.work / "slurmd.pid", self.work / "slurmctld.pid", self.munge_dir / "munged.pid"):
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        shutil.rmtree(self.munge_dir, ignore_errors=True)
