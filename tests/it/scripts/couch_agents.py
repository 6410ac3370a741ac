"""GET-modify-PUT session agents on a CouchDB-style store, as agent code writes them.

Each agent, for each of its writes: GET the document, append one message with its own id, PUT
the whole document back with the `_rev` it read. On 409 it does what agents commonly do:
even agents "take the latest _rev and PUT my copy again" (up to 5 times), odd agents read
again and re-apply their change. Agents are spread over the endpoints given. Prints one JSON
line: the ids of the writes the store answered 2xx, the other answers, and the 409s met.

usage: couch_agents.py ENDPOINTS DOC_PATH AGENTS WRITES [DIRECT]

With DIRECT, one more agent writes straight to the store at DIRECT, re-reading on its 409s
(a careful writer beside the sidecars). It makes at least WRITES writes and goes on until the
other agents are done (at most 20 * WRITES), 10-30 ms apart, so that its writes overlap
theirs however the machine schedules them, at a pace that leaves the sidecars room to commit
(a writer that rewrites the document back to back can keep every other writer's
conditional write failing, with or without turnlock).
"""
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request

endpoints = sys.argv[1].split(",")
path = sys.argv[2]
agents, writes = int(sys.argv[3]), int(sys.argv[4])
direct = sys.argv[5] if len(sys.argv) > 5 else None

lock = threading.Lock()
acked, errors, conflicts, answers = [], [], [0], []
others_done = threading.Event()


def call(method, url, doc=None):
    data = json.dumps(doc).encode() if doc is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, body.decode(errors="replace")


def agent(i, base=None):
    url = (base or endpoints[i % len(endpoints)]) + path
    rng = random.Random(i)
    for k in range(writes * 20 if base else writes):
        if base:
            if k >= writes and others_done.is_set():
                break
            time.sleep(0.01 + rng.random() * 0.02)
        mid = f"a{i}-{k}"
        status, doc = call("GET", url)
        if status != 200:
            with lock:
                errors.append({"id": mid, "status": status, "body": doc})
            continue
        doc.setdefault("messages", []).append({"id": mid, "role": "user", "content": f"agent {i} write {k}"})
        time.sleep(rng.random() * 0.004)
        # A careful writer re-reads as often as it takes; the others give up after 6 tries.
        for _ in range(100 if base else 6):
            status, answer = call("PUT", url, doc)
            if status != 409:
                break
            with lock:
                conflicts[0] += 1
            _, latest = call("GET", url)
            if i % 2 == 0 and base is None:
                doc["_rev"] = latest["_rev"]  # my copy again, with the latest _rev
            else:
                latest.setdefault("messages", []).append(doc["messages"][-1])
                doc = latest
        if 200 <= status < 300:
            with lock:
                acked.append(mid)
                answers.append(answer)
        else:
            with lock:
                errors.append({"id": mid, "status": status, "body": answer})


threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
careful = [threading.Thread(target=agent, args=(agents, direct))] if direct else []
for t in threads + careful:
    t.start()
for t in threads:
    t.join(timeout=120)
others_done.set()
for t in careful:
    t.join(timeout=120)
status, final = call("GET", endpoints[-1] + path)
print(json.dumps({"acked": acked, "errors": errors, "conflicts": conflicts[0], "answers": answers[:3], "final": final}))
