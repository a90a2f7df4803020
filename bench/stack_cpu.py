"""Where a token's CPU goes in the whole stack: CPU time of each process per output token.

Starts ``tandem up`` (extra flags after ``--tandem-args``), lets it settle, then runs ``tandem
bench`` at a fixed concurrency on 35-word chats with 64 output tokens and reads each of the
stack's processes' user + system CPU time (Linux ``/proc``) before and after. Divided by the
output tokens served, this says what the mesh costs per token beside decode's own compute: the
router, the agent, prefill_svc and Redis run on the same cores as decode's OpenMP threads.

Usage: python bench/stack_cpu.py [--concurrency 1] [--num-requests 6] [--out bench/results/stack-cpu.json]
                                 [--tandem-args ARG...]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peer import CHAT_INPUT_LEN, CHAT_OUTPUT_LEN, run_bench, running, tandem_up  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

# What each of the stack's processes has in its command line.
ROLES = ("decode_svc", "prefill_svc", "gpu_agent", "router", "redis-server")


class StackProcess(NamedTuple):
    pid: int
    role: str  # one of ROLES, else "other"
    cpu_s: float  # user + system
    zombie: bool  # dead, not yet reaped
    ppid: int


def environ_value(pid: int, name: str) -> str | None:
    """``name`` in process ``pid``'s environment (Linux /proc), None where unset or unreadable."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{name}=".encode()
    return next((e[len(prefix):].decode() for e in entries if e.startswith(prefix)), None)


def stack_processes(root_pid: int) -> list[StackProcess]:
    """``root_pid``'s descendants (Linux ``/proc``), each with its role and CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, float, bool, int]] = {}  # command line, CPU seconds, zombie, parent
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        info[pid] = (cmd, (int(fields[11]) + int(fields[12])) / tick, fields[0] == "Z", ppid)
    found: list[StackProcess] = []
    todo = list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        cmd, cpu, zombie, ppid = info[pid]
        found.append(StackProcess(pid, next((r for r in ROLES if r in cmd), "other"), cpu, zombie, ppid))
    return found


def stack_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds of ``root_pid``'s descendants, summed per role."""
    totals: dict[str, float] = {}
    for process in stack_processes(root_pid):
        totals[process.role] = totals.get(process.role, 0.0) + process.cpu_s
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=6)
    parser.add_argument("--out", default="bench/results/stack-cpu.json")
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    out = Path(args.out)
    log_path = out.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = tandem_up("Tandem", f"stack-cpu-{os.getpid()}", args.tandem_args, log_path)
    with running(server, 300.0):
        time.sleep(3.0)
        assert server.proc is not None
        before, start = stack_cpu_s(server.proc.pid), time.monotonic()
        result = run_bench(["--base-url", server.base_url, "--endpoint", "chat", "--workload", "fixed",
                            "--input-len", str(CHAT_INPUT_LEN), "--output-len", str(CHAT_OUTPUT_LEN),
                            "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                            "--no-progress"])
        after, wall_s = stack_cpu_s(server.proc.pid), time.monotonic() - start
    (run,) = result["runs"]
    tokens = sum(len(r["token_times_s"]) for r in run["requests"])
    per_token: dict[str, Any] = {role: round(1000.0 * (after.get(role, 0.0) - before.get(role, 0.0)) / tokens, 3)
                                 for role in sorted(set(after) | set(before))} if tokens else {}
    write_json({"config": vars(args), "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
                "wall_s": wall_s, "output_tokens": tokens, "cpu_ms_per_token": per_token,
                "summary": run["summary"], "command": server.cmd}, out)
    print(f"{tokens} output tokens in {wall_s:.1f} s; CPU ms per token: {per_token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
