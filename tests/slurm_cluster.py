"""A one-node Slurm cluster on this machine, with accounting, for the tests (Debian's slurm-wlm 22.05).

``Cluster(root).start()`` writes a munge key, ``slurm.conf`` and ``slurmdbd.conf`` under ``root`` and starts, each on
loopback ports of its own: munged, MariaDB (sacct reads jobs from slurmdbd, which stores them there), slurmdbd,
slurmctld and slurmd. The node has this machine's real CPUs and memory (``slurmd -C``), one partition ``inf2``. It
waits until the node is idle; ``stop()`` stops everything it started. The Slurm commands (sbatch, squeue, sacct,
scancel) find the cluster through ``SLURM_CONF``, which ``env()`` gives.

Needs root and the Debian packages slurm-wlm, slurmdbd, munge and mariadb-server (``make slurm-packages``). Run by
hand: ``python -m tests.slurm_cluster DIR`` starts one and prints the ``SLURM_CONF`` to export; Ctrl-C stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PARTITION = "inf2"
CLUSTER = "pipeline-test"
ACCOUNT = "builds"  # the one account; jobs under any other are refused (AccountingStorageEnforce=associations)
PROGRAMS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct",
            "sacctmgr")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if not shutil.which(p) and not Path("/usr/sbin", p).exists()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """This machine as slurmd sees it: ``NodeName=... CPUs=... RealMemory=...``."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0]


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.node = node_line()
        self.node_name = self.node.split()[0].split("=")[1]
        self.memory_mb = int(next(f for f in self.node.split() if f.startswith("RealMemory=")).split("=")[1])
        self.cpus = int(next(f for f in self.node.split() if f.startswith("CPUs=")).split("=")[1])

    # -- files -------------------------------------------------------------------------------------------------

    def write(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "run", "db"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.munge_socket = r / "run" / "munge.socket"
        key = r / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.db_port, self.dbd_port = free_port(), free_port()
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        (r / "slurmdbd.conf").write_text(
            auth + f"DbdHost=localhost\nDbdPort={self.dbd_port}\nSlurmUser=root\nPidFile={r}/run/slurmdbd.pid\n"
            f"LogFile={r}/log/slurmdbd.log\nStorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            f"StoragePort={self.db_port}\nStorageUser=root\nStorageLoc=slurm_acct_db\n")
        (r / "slurmdbd.conf").chmod(0o600)  # slurmdbd refuses a readable one: it may hold the database password
        # No cgroups in a container: processes are tracked by their parent ids, and memory by polling, which kills a
        # step over its --mem (OverMemoryKill) as the cgroup would.
        (r / "slurm.conf").write_text(
            auth + f"ClusterName={CLUSTER}\nSlurmctldHost={self.node_name}\nSlurmctldPort={self.ctld_port}\n"
            f"SlurmdPort={self.slurmd_port}\nSlurmUser=root\nSlurmdUser=root\nStateSaveLocation={r}/state\n"
            f"SlurmdSpoolDir={r}/spool\nSlurmctldPidFile={r}/run/slurmctld.pid\nSlurmdPidFile={r}/run/slurmd.pid\n"
            f"SlurmctldLogFile={r}/log/slurmctld.log\nSlurmdLogFile={r}/log/slurmd.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU_Memory\nReturnToService=2\n"
            "JobAcctGatherType=jobacct_gather/linux\nJobAcctGatherFrequency=1\n"
            "JobAcctGatherParams=OverMemoryKill\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
            f"AccountingStoragePort={self.dbd_port}\nAccountingStoragePass={self.munge_socket}\n"
            "AccountingStorageEnforce=associations\nSchedulerParameters=sched_interval=1\n"
            "SlurmctldParameters=enable_configless\nKillWait=5\nInactiveLimit=0\nMinJobAge=2\n"
            f"{self.node} State=UNKNOWN\n"
            f"PartitionName={PARTITION} Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP\n")

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def jobs(self, job_ids: list[str] | None = None) -> list[dict]:
        """The jobs sacct knows of (all, or ``job_ids``): id, name, state, requested memory (MiB) and CPUs, node, and
        the submit, start and end times as sacct prints them."""
        fields = "JobID,JobName%40,State,ReqMem,ReqCPUS,NodeList,Submit,Start,End"
        which = ["-j", ",".join(job_ids)] if job_ids else ["-S", "2000-01-01"]
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", fields, *which], capture_output=True, text=True,
                             env={**os.environ, **self.env()}, timeout=60, check=True).stdout
        rows = []
        for line in out.splitlines():
            job_id, name, state, mem, cpus, node, submit, start, end = line.split("|")
            size = {"M": 1, "G": 1024}[mem[-1]] * int(float(mem[:-1]))
            rows.append({"id": job_id, "name": name, "state": state.split()[0], "mem_mb": size, "cpus": int(cpus),
                         "node": node, "submit": submit, "start": start, "end": end})
        return rows

    # -- processes -----------------------------------------------------------------------------------------------

    def spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.out", "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **self.env()})
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 120) -> Cluster:
        self.write()
        r = self.root
        try:
            self.spawn(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                        f"--key-file={r}/munge.key", f"--pid-file={r}/run/munged.pid",
                        f"--log-file={r}/log/munged.log", f"--seed-file={r}/run/munged.seed"], "munged")
            subprocess.run(["mariadb-install-db", "--user=root", f"--datadir={r}/db", "--auth-root-authentication"
                            "-method=normal", "--skip-test-db"], check=True, capture_output=True)
            self.spawn(["mariadbd", "--user=root", f"--datadir={r}/db", f"--port={self.db_port}",
                        "--bind-address=127.0.0.1", f"--socket={r}/run/mariadb.sock", f"--pid-file={r}/run/db.pid",
                        "--skip-name-resolve", "--innodb-buffer-pool-size=32M"], "mariadbd")
            self.wait_port(self.db_port, timeout, "mariadbd")
            self.spawn(["slurmdbd", "-D"], "slurmdbd")  # reads slurmdbd.conf beside $SLURM_CONF
            self.wait_port(self.dbd_port, timeout, "slurmdbd")
            for args in (["add", "cluster", CLUSTER], ["add", "account", ACCOUNT, f"cluster={CLUSTER}"],
                         ["add", "user", "root", f"account={ACCOUNT}", f"cluster={CLUSTER}"]):
                subprocess.run(["sacctmgr", "-i", *args], check=True, capture_output=True, timeout=60,
                               env={**os.environ, **self.env()})
            self.spawn(["slurmctld", "-D", "-i", "-f", str(r / "slurm.conf")], "slurmctld")
            self.wait_port(self.ctld_port, timeout, "slurmctld")
            self.spawn(["slurmd", "-D", "-f", str(r / "slurm.conf")], "slurmd")
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_port(self, port: int, timeout: float, name: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{self.logs()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not listen on port {port} within {timeout:.0f} s:\n{self.logs()}")

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                 env={**os.environ, **self.env()})
            state = out.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the node is {state!r}, not idle, after {timeout:.0f} s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.root / "log").glob("*"))
                         if p.is_file())

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop everything started, as Ctrl-C does
    cluster = Cluster(Path(sys.argv[1]).resolve()).start()
    print(f"export SLURM_CONF={cluster.root / 'slurm.conf'}", flush=True)
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        cluster.stop()
