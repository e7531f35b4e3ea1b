"""`artgw serve --workers N` (artgw/workers.py): N processes on one port, one store, a journal each.

With the stand-in engine: calls on fresh connections land on several workers (which process holds the server
end of each connection is read from the kernel), yet a rollout whose calls were spread over them is one rollout
in the store, a group made through one worker takes rollouts the others recorded, and a stop loses no record.
"""

from __future__ import annotations

import http.client
import json
import sqlite3
from collections import Counter
from pathlib import Path

import httpx
import psutil

from tests.conftest import poll, start_gateway

WORKERS = 3
CALLS = 24
BODY = json.dumps({"model": "my-agent", "messages": [{"role": "user", "content": "hello"}]})


def _call(port: int, rollout_id: str, workers: list[psutil.Process]) -> int:
    """One call on a connection of its own; the pid of the worker that served it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            BODY,
            {"Content-Type": "application/json", "X-ART-Rollout-Id": rollout_id},
        )
        answer = conn.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()
        assert conn.sock is not None  # still open: the answer was read, the connection kept
        client_port = conn.sock.getsockname()[1]
        holders = [
            w.pid
            for w in workers
            for c in w.net_connections(kind="tcp")
            if c.laddr.port == port and c.raddr and c.raddr.port == client_port
        ]
        assert len(holders) == 1, holders
        return holders[0]
    finally:
        conn.close()


def test_workers_share_rollouts_groups_and_lose_no_record(upstream: str, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, "--upstream", upstream, "--workers", str(WORKERS), wait=False)
    try:
        poll(lambda: gateway.log().count("ART Gateway ready") == WORKERS, 60, "every worker ready")
        first = psutil.Process(gateway.proc.pid)
        workers = [first, *first.children()]
        assert len(workers) == WORKERS
        port = int(gateway.url.rsplit(":", 1)[1])

        served_by = Counter(_call(port, "spread", workers) for _ in range(CALLS))
        assert len(served_by) >= 2, served_by  # one rollout's calls on several workers
        others = [f"other-{i}" for i in range(4)]
        for rid in others:
            _call(port, rid, workers)

        # A group of rollouts the workers recorded, made through whichever worker takes the connection.
        group = httpx.post(
            f"{gateway.base_url}/art/groups",
            json={
                "model": "my-agent",
                "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(others)],
            },
            headers=gateway.admin,
            timeout=30,
        )
        assert group.status_code == 201, group.text
        got = httpx.get(f"{gateway.base_url}/art/rollouts/spread", headers=gateway.admin, timeout=30)
        assert got.status_code == 200, got.text
    finally:
        assert gateway.stop() == 0, gateway.log()
    # Every worker wrote all its records before the stop ended: none was left in a journal to replay.
    with sqlite3.connect(gateway.db_path) as db:
        counts = dict(db.execute("SELECT rollout_id, count(*) FROM calls GROUP BY rollout_id").fetchall())
    assert counts == {"spread": CALLS, **{rid: 1 for rid in others}}
    assert not list((gateway.data_dir / "journal").rglob("seg-*.log"))
