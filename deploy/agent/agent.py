"""A stand-in agent replica for the Docker setup: an HTTP service that, for each turn it is
asked to run, reads the session from its context store, appends one message and writes the
whole document back (a plain GET-modify-PUT, as many agent frameworks do). Its store URL is
CONTEXT_STORE_URL: the turnlock sidecar in the same network namespace, or the store itself.

POST /turn {"session": "s-1", "id": "m-…", "content": "…"} -> the store's status and body.
Standard library only.
"""

import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STORE = os.environ.get("CONTEXT_STORE_URL", "http://127.0.0.1:7070").rstrip("/")
PORT = int(os.environ.get("AGENT_PORT", "8000"))
TIMEOUT = 10


def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(STORE + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as res:
            return res.status, res.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


ATTEMPTS = 8


def run_turn(session, message_id, content):
    """Runs the turn, again from a fresh read when the store (or turnlock) answers that the
    session is busy (503), that the copy was stale (409), or that the session it found absent
    was created meanwhile and a write to it needs the version read (428), as a careful agent
    does."""
    for attempt in range(ATTEMPTS):
        status, body = try_turn(session, message_id, content)
        if status not in (409, 428, 503) or attempt == ATTEMPTS - 1:
            return status, body
        time.sleep(0.01 * (attempt + 1) + random.random() * 0.02)
    return status, body


def try_turn(session, message_id, content):
    path = f"/v1/sessions/{session}"
    status, body = call("GET", path)
    if status == 404:
        doc = {"session": session, "turn": 0, "messages": []}
    elif status == 200:
        doc = json.loads(body)
    else:
        return status, body
    doc["turn"] = doc.get("turn", 0) + 1
    doc.setdefault("messages", []).append(
        {"id": message_id, "turn": doc["turn"], "role": "assistant", "content": content}
    )
    return call("PUT", path, doc)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply(200, b'{"status":"ok"}')

    def do_POST(self):
        if self.path != "/turn":
            return self.reply(404, b'{"error":"not_found"}')
        try:
            length = int(self.headers.get("content-length", "0"))
            turn = json.loads(self.rfile.read(length))
            status, body = run_turn(turn["session"], turn["id"], turn.get("content", ""))
        except (ValueError, KeyError) as e:
            return self.reply(400, json.dumps({"error": "bad_request", "message": str(e)}).encode())
        except OSError as e:
            return self.reply(502, json.dumps({"error": "store_unreachable", "message": str(e)}).encode())
        self.reply(status, body)

    def reply(self, status, body):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    # As a container's PID 1 no default handler ends the process on SIGTERM: `docker stop`
    # would wait its whole grace period and then kill it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"agent listening on :{PORT}, store at {STORE}", file=sys.stderr, flush=True)
    ThreadingHTTPServer(("0.0.0.0", PORT), Handler).serve_forever()
