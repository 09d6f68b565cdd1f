"""``sdpq cluster``: run a torchrun job on an emulated cluster of K nodes x L ranks.

Each node is a network namespace (``sdpq.launch.netns``); one ``torchrun`` per node joins a
c10d rendezvous hosted on node 0, exactly as on a real cluster, so LOCAL_WORLD_SIZE, node ranks
and the inter-node link are real. ``--measure`` first checks the shaped link with a TCP stream.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from .netns import EmulatedNodes, cleanup_stale

__all__ = ["add_arguments", "main", "measure_link", "run_job", "torchrun_command"]


def torchrun_command(
    nodes: int,
    node_rank: int,
    ranks_per_node: int,
    endpoint: str,
    job_id: str,
    command: list[str],
    local_addr: str | None = None,
) -> list[str]:
    """The torchrun line of one node (c10d rendezvous; `command` is a python script or -m module)."""
    module = command[:2] if command[:1] == ["-m"] else None
    head = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={ranks_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_id}",
        # Namespaces share the hostname, so torchrun cannot tell which node owns the endpoint.
        f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}",
    ]
    if local_addr:  # else workers get the machine's hostname as MASTER_ADDR, outside the namespaces
        head.append(f"--local-addr={local_addr}")
    if module:
        return head + ["--module", command[1]] + command[2:]
    return head + command


def measure_link(cluster: EmulatedNodes, megabytes: int = 24) -> float:
    """Mbit/s of one TCP stream from node 1 to node 0 through the shaped link."""
    server = (
        "import socket,time\n"
        f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{cluster.address(0)}',29499));s.listen(1)\n"
        "c,_=s.accept();n=0;t=time.time()\n"
        "while True:\n d=c.recv(1<<20)\n if not d: break\n n+=len(d)\n"
        "print(n*8/(time.time()-t)/1e6)\n"
    )
    client = (
        "import socket,time\n"
        "for _ in range(50):\n"
        f" try: s=socket.create_connection(('{cluster.address(0)}',29499)); break\n"
        " except OSError: time.sleep(0.1)\n"
        f"b=b'x'*(1<<20)\nfor _ in range({megabytes}): s.sendall(b)\ns.close()\n"
    )
    srv = subprocess.Popen(cluster.exec_prefix(0) + [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    subprocess.run(cluster.exec_prefix(1) + [sys.executable, "-c", client], check=True, timeout=120)
    out, _ = srv.communicate(timeout=120)
    return float(out.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit", help="inter-node rate per direction (tbf), e.g. 200mbit, 5gbit")
    p.add_argument("--latency", default=None, help="one-way inter-node delay (netem), e.g. 500us, 2ms; needs sch_netem")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on node 0")
    p.add_argument("--measure", action="store_true", help="measure the shaped link with TCP before running")
    p.add_argument("--timeout", type=float, default=3600, help="kill the job after this many seconds")
    p.add_argument("--cleanup", action="store_true", help="only delete namespaces left by killed runs")
    p.add_argument(
        "--per-node",
        action="store_true",
        help="run the command as given on every node (a per-node launcher script) with NNODES, "
        "NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, NODE_ADDR set, instead of wrapping it in torchrun",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py args | -- -m module args")


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float) -> int:
    """Wait for every node; the worst exit code (124 on timeout). A failing node ends the wait
    at once; once one node has exited the others get `grace` seconds to follow."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            break  # one node failed or time is up: stop the others instead of hanging
        if any(p.returncode is not None for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    return max((p.returncode or 0) if p.returncode is not None else 124 for p in procs)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """End every node's process group still running (TERM, then KILL after 10 s)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_job(
    cluster: EmulatedNodes,
    command: list[str],
    ranks_per_node: int,
    *,
    port: int = 29400,
    timeout: float = 3600,
    per_node: bool = False,
    env: dict | None = None,
    logs: Path | None = None,
    grace: float = 120,
) -> int:
    """Run `command` on every node of `cluster` (wrapped in torchrun unless `per_node`) and wait.

    Returns the worst exit code (124 on timeout). A failing node stops the others instead of
    leaving them hanging in a collective, and once one node has exited the others get `grace`
    seconds to follow (a node left alone in a rendezvous or collective would wait forever).
    With `logs`, node i's output goes to ``logs/node<i>.log`` instead of the terminal.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    env["SDPQ_EMULATED_BANDWIDTH"] = cluster.bandwidth or "unshaped"
    endpoint = f"{cluster.address(0)}:{port}"
    job = f"sdpq-{os.getpid()}-{port}"
    procs: list[subprocess.Popen] = []
    try:
        for i in range(cluster.nodes):
            node_env = dict(
                env,
                NNODES=str(cluster.nodes),
                NODE_RANK=str(i),
                NPROC_PER_NODE=str(ranks_per_node),
                MASTER_ADDR=cluster.address(0),
                NODE_ADDR=cluster.address(i),
            )
            job_cmd = (
                command
                if per_node
                else torchrun_command(cluster.nodes, i, ranks_per_node, endpoint, job, command, cluster.address(i))
            )
            cmd = cluster.exec_prefix(i) + job_cmd
            out = None
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                out = (logs / f"node{i}.log").open("w")
            print(
                f"[sdpq cluster] node {i} ({cluster.address(i)}): {shlex.join(cmd)}", file=out or sys.stdout, flush=True
            )
            procs.append(subprocess.Popen(cmd, env=node_env, start_new_session=True, stdout=out, stderr=out))
            if out is not None:
                out.close()  # the child holds its own descriptor
        return _wait_all(procs, timeout, grace)
    finally:
        _stop_all(procs)


def main(args: argparse.Namespace) -> int:
    if args.cleanup:
        print("deleted:", " ".join(cleanup_stale()) or "nothing")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("sdpq cluster: give the job after --, e.g. -- -m sdpq.train --backend fsdp2")

    def _stop(signum, _frame):  # turn SIGTERM into the same clean path as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, _stop)
    try:
        with EmulatedNodes(args.nodes, args.bandwidth, latency=args.latency) as cluster:
            if args.measure and args.nodes > 1:
                print(f"[sdpq cluster] link {args.bandwidth}: measured {measure_link(cluster):.0f} Mbit/s", flush=True)
            before = cluster.link_bytes()
            rc = run_job(
                cluster, command, args.ranks_per_node, port=args.port, timeout=args.timeout, per_node=args.per_node
            )
            print(
                f"[sdpq cluster] exit {rc}; inter-node link carried {(cluster.link_bytes() - before) / 1e6:.2f} MB",
                flush=True,
            )
            return rc
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="sdpq cluster", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
