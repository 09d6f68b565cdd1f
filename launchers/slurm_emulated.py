"""Run ``launchers/slurm.sbatch`` on a real Slurm cluster of emulated nodes on this machine.

Builds K network namespaces (``sdpq.launch.netns.EmulatedNodes``), starts ``munged`` once,
``slurmctld`` in node 0's namespace and one ``slurmd -N node<i>`` inside each node's namespace
(their own addresses, 10.213.7.x), submits ``sbatch --wait launchers/slurm.sbatch ...`` and
prints the job's output; everything is stopped and removed on the way out, also on failure.
It checks the Slurm path of a launcher end to end (sbatch -> srun -> one task per rank ->
``sdpq.launch.env`` -> gloo across the shaped link) without a cluster. Needs root and Debian's
``slurmctld slurmd munge`` packages (``apt-get install slurmctld slurmd munge``).

    .venv/bin/python launchers/slurm_emulated.py --nodes 2 --tasks-per-node 2 -- --backend fsdp2 --steps 20
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sdpq.launch.netns import EmulatedNodes  # noqa: E402

_CONF = """\
ClusterName=sdpqemu
SlurmctldHost={host}({ctl})
MailProg=/bin/true
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/slurmd-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
{nodes}
PartitionName=emu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"slurm_emulated: {', '.join(missing)} not found; apt-get install slurmctld slurmd munge")


def _wait_nodes_idle(env: dict, prefix: list[str], nodes: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(prefix + ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
        states = [line.split()[1] for line in out.stdout.splitlines() if line.strip()]
        if len(states) == nodes and all(s == "idle" for s in states):
            return
        time.sleep(1)
    raise SystemExit(f"slurm_emulated: nodes not idle after {timeout:.0f} s: {out.stdout.strip()} {out.stderr.strip()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--tasks-per-node", type=int, default=2)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- arguments of python -m sdpq.train")
    args = ap.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if os.geteuid() != 0:
        raise SystemExit("slurm_emulated: network namespaces and slurmd need root")
    _need("slurmctld", "slurmd", "sbatch", "munged")
    procs: list[subprocess.Popen] = []
    work = Path(tempfile.mkdtemp(prefix="sdpq-slurm-"))
    hosts_backup = Path("/etc/hosts").read_text()
    try:
        with EmulatedNodes(args.nodes, args.bandwidth) as cluster:
            names = [f"node{i}" for i in range(args.nodes)]
            node_lines = "\n".join(f"NodeName={n} NodeAddr={cluster.address(i)} CPUs={os.cpu_count()} State=UNKNOWN"
                                   for i, n in enumerate(names))
            for d in ["ctld"] + [f"slurmd-{n}" for n in names]:
                (work / d).mkdir()
            conf = work / "slurm.conf"
            # All namespaces share the machine's hostname: slurmctld must find itself under it.
            conf.write_text(_CONF.format(host=socket.gethostname(), ctl=cluster.address(0), d=work, nodes=node_lines))
            # srun and MASTER_ADDR (the first host of the job) resolve node names.
            Path("/etc/hosts").write_text(hosts_backup + "".join(
                f"{cluster.address(i)} {n}\n" for i, n in enumerate(names)))
            env = dict(os.environ, SLURM_CONF=str(conf))
            Path("/run/munge").mkdir(exist_ok=True)
            subprocess.run(["munged", "--force"], check=False, capture_output=True)  # idempotent if running
            # Note: nsenter --net, not `ip netns exec`: the latter mounts a fresh /sys without the
            # cgroup hierarchies that slurmd needs.
            ns = [["nsenter", f"--net=/run/netns/{cluster.namespace(i)}"] for i in range(args.nodes)]
            ns0 = ns[0]
            procs.append(subprocess.Popen(ns0 + ["slurmctld", "-D", "-i"], env=env, start_new_session=True))
            time.sleep(2)
            for i, n in enumerate(names):
                procs.append(subprocess.Popen(ns[i] + ["slurmd", "-D", "-N", n], env=env, start_new_session=True))
            _wait_nodes_idle(env, ns0, args.nodes)
            # The ranks talk over each namespace's eth0 (the hostname resolves outside them).
            job_env = dict(env, GLOO_SOCKET_IFNAME="eth0", SDPQ_REPO=str(REPO), OMP_NUM_THREADS="1")
            out = work / "job.out"
            cmd = ns0 + ["sbatch", "--wait", f"--nodes={args.nodes}", f"--ntasks-per-node={args.tasks_per_node}",
                         "--cpus-per-task=1", f"--output={out}", f"--chdir={REPO}",
                         str(REPO / "launchers" / "slurm.sbatch"), *train_args]
            print("[slurm_emulated]", " ".join(cmd[len(ns0):]), flush=True)
            rc = subprocess.run(cmd, env=job_env, timeout=args.timeout).returncode
            print(out.read_text() if out.exists() else "(no job output)", flush=True)
            print(f"[slurm_emulated] sbatch exit {rc}", flush=True)
            return rc
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        Path("/etc/hosts").write_text(hosts_backup)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
