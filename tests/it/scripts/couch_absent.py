"""Agents on CouchDB documents that do not exist yet: some through sidecars, some careful ones
straight to the store.

Each agent, for each write: GET the document (a 404 starts a copy `{"_id", "messages": []}`),
append one message with its own id, PUT the copy. On 409, an agent through a sidecar "takes the
latest _rev and PUTs its copy again"; a careful agent straight to the store reads again and
re-applies its change. At most 30 tries per write.

usage: couch_absent.py SIDECARS DIRECT DB DOCS THROUGH STRAIGHT WRITES
Prints one JSON line: writes, acknowledged, lost and duplicated message ids, other answers,
and the merge conflicts turnlock answered (409 with `turnlock_error: conflict`).
"""
import collections
import json
import sys
import threading
import urllib.error
import urllib.request

sidecars = sys.argv[1].split(",")
direct, db = sys.argv[2], sys.argv[3]
docs, through, straight, writes = (int(a) for a in sys.argv[4:8])

lock = threading.Lock()
acked, errors, turnlock_conflicts = [], [], []


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


def agent(i, careful):
    base = direct if careful else sidecars[i % len(sidecars)]
    for k in range(writes):
        doc_id = f"d{(i + k) % docs}"
        url = f"{base}/{db}/{doc_id}"
        mid = f"{'s' if careful else 'p'}{i}-{k}"
        mine = {"id": mid, "content": mid}
        status, doc = call("GET", url)
        doc = doc if status == 200 else {"_id": doc_id, "messages": []}
        doc.setdefault("messages", []).append(mine)
        for _ in range(30):
            status, answer = call("PUT", url, doc)
            if status != 409:
                break
            if isinstance(answer, dict) and answer.get("turnlock_error") == "conflict":
                with lock:
                    turnlock_conflicts.append(answer.get("reason"))
            s, latest = call("GET", url)
            if careful:
                doc = latest if s == 200 else {"_id": doc_id, "messages": []}
                doc.setdefault("messages", []).append(mine)
            elif s == 200:
                doc["_rev"] = latest["_rev"]
            else:
                doc.pop("_rev", None)
        with lock:
            if 200 <= status < 300:
                acked.append((doc_id, mid))
            else:
                errors.append({"id": mid, "status": status, "body": answer})


threads = [threading.Thread(target=agent, args=(i, False)) for i in range(through)]
threads += [threading.Thread(target=agent, args=(i, True)) for i in range(straight)]
for t in threads:
    t.start()
for t in threads:
    t.join()
lost, dup = [], []
for d in range(docs):
    status, doc = call("GET", f"{direct}/{db}/d{d}")
    ids = collections.Counter(m.get("id") for m in (doc.get("messages", []) if status == 200 else []))
    dup += [m for m, n in ids.items() if n > 1]
    lost += [m for (doc_id, m) in acked if doc_id == f"d{d}" and ids[m] == 0]
print(json.dumps({"writes": (through + straight) * writes, "acked": len(acked), "lost": lost, "dup": dup, "errors": errors[:5], "error_count": len(errors), "turnlock_conflicts": turnlock_conflicts[:5], "turnlock_conflict_count": len(turnlock_conflicts)}))
