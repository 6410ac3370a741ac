"""Load generator for the Docker setup: runs turns of the same sessions through every agent
replica at once, then reads each session from the store and counts acknowledged messages that
are missing (lost) or stored twice (duplicated). Exits 1 if any write was lost or duplicated,
or if none was acknowledged.

Environment: AGENTS (comma-separated base URLs), STORE_URL, SESSIONS, TURNS (per agent and
session), WORKERS. Standard library only.
"""

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

AGENTS = [a.rstrip("/") for a in os.environ.get("AGENTS", "http://127.0.0.1:8000").split(",") if a]
STORE = os.environ.get("STORE_URL", "http://127.0.0.1:8080").rstrip("/")
SESSIONS = int(os.environ.get("SESSIONS", "4"))
TURNS = int(os.environ.get("TURNS", "25"))
WORKERS = int(os.environ.get("WORKERS", "16"))
RUN = os.environ.get("RUN_ID", str(int(time.time())))
TIMEOUT = 15


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as res:
            return res.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_ready(deadline):
    for url in AGENTS + [STORE + "/v1/sessions/probe"]:
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit(f"{url} is not answering")
                time.sleep(0.2)


def main():
    wait_ready(time.time() + 60)
    jobs = []
    for t in range(TURNS):
        for a, agent in enumerate(AGENTS):
            for s in range(SESSIONS):
                session = f"load-{RUN}-{s}"
                jobs.append((agent, session, f"m-{RUN}-{s}-{a}-{t}"))
    started = time.time()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        statuses = list(pool.map(lambda j: post(j[0] + "/turn", {"session": j[1], "id": j[2]}), jobs))
    elapsed = time.time() - started
    acked = [j for j, st in zip(jobs, statuses) if 200 <= st < 300]
    refused = {}
    for st in statuses:
        if not 200 <= st < 300:
            refused[st] = refused.get(st, 0) + 1

    stored = {}
    for s in range(SESSIONS):
        session = f"load-{RUN}-{s}"
        try:
            with urllib.request.urlopen(f"{STORE}/v1/sessions/{session}", timeout=TIMEOUT) as res:
                doc = json.loads(res.read())
        except urllib.error.HTTPError:
            doc = {"messages": []}
        for m in doc.get("messages", []):
            stored[m["id"]] = stored.get(m["id"], 0) + 1
    lost = [j[2] for j in acked if j[2] not in stored]
    duplicated = [i for i, n in stored.items() if n > 1]
    print(
        json.dumps(
            {
                "agents": len(AGENTS),
                "sessions": SESSIONS,
                "writes": len(jobs),
                "acknowledged": len(acked),
                "refused_by_status": refused,
                "lost": len(lost),
                "duplicated": len(duplicated),
                "seconds": round(elapsed, 2),
            }
        ),
        flush=True,
    )
    if lost or duplicated or not acked:
        print(f"FAIL: {len(lost)} acknowledged writes lost, {len(duplicated)} duplicated", flush=True)
        return 1
    print(f"OK: {len(acked)} acknowledged writes, none lost or duplicated", flush=True)
    return 0


if __name__ == "__main__":
    # As a container's PID 1 no default handler ends the process on SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
