"""Strands Agents' S3SessionManager, driven as a stateless service drives it: one `Agent` per
request, two replicas serving one session, several rounds of one request per replica at once.

The model is a stand-in (no provider, no network): it answers after ~50 ms.

    strands_replicas.py race ENDPOINTS BUCKET SESSION ROUNDS STORE_URL
    strands_replicas.py redact ENDPOINT BUCKET SESSION STORE_URL
    strands_replicas.py first ENDPOINTS BUCKET SESSION STORE_URL
    strands_replicas.py put ENDPOINT BUCKET KEY

ENDPOINTS: one S3 endpoint per replica, comma-separated (sidecars, or the store itself).
STORE_URL: the store itself, for the final read. Prints one JSON line.
"""

import asyncio
import json
import sys
import threading
import time
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from strands import Agent
from strands.models.model import Model
from strands.session.s3_session_manager import S3SessionManager

REGION = "us-east-1"
CONFIG = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"})


class StandInModel(Model):
    """Answers `answer to <prompt>` after 50 ms."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}

    def update_config(self, **model_config: Any) -> None:
        self.config.update(model_config)

    def get_config(self) -> Any:
        return self.config

    async def structured_output(self, output_model, prompt, system_prompt=None, **kwargs):  # noqa: ANN001
        raise NotImplementedError
        yield  # pragma: no cover

    async def stream(self, messages, tool_specs=None, system_prompt=None, **kwargs):  # noqa: ANN001
        await asyncio.sleep(0.05)
        last = messages[-1]["content"][0].get("text", "")
        yield {"messageStart": {"role": "assistant"}}
        yield {"contentBlockStart": {"start": {}}}
        yield {"contentBlockDelta": {"delta": {"text": f"answer to {last}"}}}
        yield {"contentBlockStop": {}}
        yield {"messageStop": {"stopReason": "end_turn"}}


class Recording(S3SessionManager):
    """Records each message object this request's PUT was acknowledged for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.written: list[dict[str, Any]] = []
        self.session_created_at: str | None = None
        super().__init__(*args, **kwargs)

    def create_session(self, session, **kwargs):  # noqa: ANN001
        created = super().create_session(session, **kwargs)
        self.session_created_at = session.created_at
        return created

    def create_message(self, session_id, agent_id, session_message, **kwargs):  # noqa: ANN001
        super().create_message(session_id, agent_id, session_message, **kwargs)
        self.written.append(
            {
                "index": session_message.message_id,
                "created_at": session_message.created_at,
                "text": session_message.message["content"][0].get("text", ""),
            }
        )


def manager(endpoint: str, bucket: str, session: str) -> Recording:
    return Recording(
        session_id=session,
        bucket=bucket,
        prefix="strands",
        endpoint_url=endpoint,
        region_name=REGION,
        boto_client_config=CONFIG,
    )


def request(endpoint: str, bucket: str, session: str, prompt: str) -> dict[str, Any]:
    """One request of a stateless service: a fresh Agent on the stored session."""
    started = time.monotonic()
    out: dict[str, Any] = {"prompt": prompt, "ok": False}
    sm = None
    try:
        sm = manager(endpoint, bucket, session)
        agent = Agent(model=StandInModel(), session_manager=sm, callback_handler=None)
        agent(prompt)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - what the replica's caller sees
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        cause = e
        while cause is not None:
            if isinstance(cause, ClientError):
                out["code"] = cause.response.get("Error", {}).get("Code")
                out["status"] = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                out["attempts"] = cause.response.get("ResponseMetadata", {}).get("RetryAttempts")
            cause = cause.__cause__ or cause.__context__
    out["seconds"] = round(time.monotonic() - started, 3)
    out["written"] = sm.written if sm is not None else []
    out["session_created_at"] = sm.session_created_at if sm is not None else None
    return out


def stored(store_url: str, bucket: str, session: str) -> dict[int, dict[str, Any]]:
    s3 = boto3.client("s3", endpoint_url=store_url, region_name=REGION, config=CONFIG)
    prefix = f"strands/session_{session}/agents/agent_default/messages/"
    out: dict[int, dict[str, Any]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            name = obj["Key"].rsplit("/", 1)[-1]
            index = int(name[len("message_") : -len(".json")])
            body = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            out[index] = body
    return out


def ensure_bucket(store_url: str, bucket: str) -> None:
    s3 = boto3.client("s3", endpoint_url=store_url, region_name=REGION, config=CONFIG)
    try:
        s3.create_bucket(Bucket=bucket)
    except ClientError as e:
        if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def race(endpoints: list[str], bucket: str, session: str, rounds: int, store_url: str) -> dict[str, Any]:
    ensure_bucket(store_url, bucket)
    # The session is created by a first request, alone.
    first = request(endpoints[0], bucket, session, "hello")
    requests = [first]
    for r in range(rounds):
        barrier = threading.Barrier(len(endpoints))
        results: list[dict[str, Any]] = [{} for _ in endpoints]

        def one(i: int, ep: str) -> None:
            barrier.wait(timeout=30)
            results[i] = request(ep, bucket, session, f"round {r} replica {i}")

        threads = [threading.Thread(target=one, args=(i, ep)) for i, ep in enumerate(endpoints)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        requests.extend(results)
    # The next request on the session, after the races.
    after = request(endpoints[0], bucket, session, "after the races")
    requests.append(after)
    held = stored(store_url, bucket, session)
    texts = {m["message"]["content"][0].get("text", "") for m in held.values()}
    lost = []  # messages of requests that returned normally, not stored
    replaced = []  # acknowledged message objects that now hold another request's message
    for q in requests:
        for w in q["written"]:
            now = held.get(w["index"])
            if now is None or now.get("created_at") != w["created_at"]:
                replaced.append({"index": w["index"], "text": w["text"], "by": now and now["message"]["content"][0].get("text")})
        if q["ok"]:
            for t in (q["prompt"], f"answer to {q['prompt']}"):
                if t not in texts:
                    lost.append(t)
    ok = [q for q in requests if q["ok"]]
    failed = [q for q in requests if not q["ok"]]
    return {
        "requests": len(requests),
        "ok": len(ok),
        "failed": [{k: q.get(k) for k in ("prompt", "error", "code", "status", "attempts", "seconds")} for q in failed],
        "expected": 2 * len(ok),
        "stored": len(held),
        "lost": lost,
        "replaced": replaced,
        "after_ok": after["ok"],
        "max_seconds": max(q["seconds"] for q in requests),
    }


def first(endpoints: list[str], bucket: str, session: str, store_url: str) -> dict[str, Any]:
    """The first requests of a new session, one per replica at once: each creates the session."""
    ensure_bucket(store_url, bucket)
    barrier = threading.Barrier(len(endpoints))
    results: list[dict[str, Any]] = [{} for _ in endpoints]

    def one(i: int, ep: str) -> None:
        barrier.wait(timeout=30)
        results[i] = request(ep, bucket, session, f"first {i}")

    threads = [threading.Thread(target=one, args=(i, ep)) for i, ep in enumerate(endpoints)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    s3 = boto3.client("s3", endpoint_url=store_url, region_name=REGION, config=CONFIG)
    key = f"strands/session_{session}/session.json"
    stored_session = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    creators = [q["session_created_at"] for q in results if q["session_created_at"]]
    return {
        "results": [{k: q.get(k) for k in ("ok", "error", "code", "status", "attempts", "seconds")} for q in results],
        # Creations acknowledged to a request whose session.json was then replaced.
        "replaced": [c for c in creators if c != stored_session.get("created_at")],
        "creators": len(creators),
    }


def redact(endpoint: str, bucket: str, session: str, store_url: str) -> dict[str, Any]:
    """The framework's own rewrite of a message: redacting the latest one, by its writer."""
    ensure_bucket(store_url, bucket)
    sm = manager(endpoint, bucket, session)
    agent = Agent(model=StandInModel(), session_manager=sm, callback_handler=None)
    agent("my card is 4111")
    out: dict[str, Any] = {}
    try:
        sm.redact_latest_message({"role": "assistant", "content": [{"text": "[redacted]"}]}, agent)
        out["redacted"] = True
    except Exception as e:  # noqa: BLE001
        out["redacted"] = False
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    held = stored(store_url, bucket, session)
    last = held[max(held)]
    out["stored_redact"] = last.get("redact_message")
    out["stored_message"] = last["message"]["content"][0].get("text")
    # A fresh agent on the session sees the redacted text.
    fresh = Agent(model=StandInModel(), session_manager=manager(endpoint, bucket, session), callback_handler=None)
    out["seen"] = fresh.messages[-1]["content"][0].get("text")
    return out


def main() -> None:
    cmd = sys.argv[1]
    if cmd == "race":
        eps, bucket, session, rounds, store = sys.argv[2:7]
        print(json.dumps(race(eps.split(","), bucket, session, int(rounds), store)))
    elif cmd == "first":
        eps, bucket, session, store = sys.argv[2:6]
        print(json.dumps(first(eps.split(","), bucket, session, store)))
    elif cmd == "put":
        # A PUT of an object no route lists (passed through), as the framework's multi-agent
        # state is written.
        ep, bucket, key = sys.argv[2:5]
        s3 = boto3.client("s3", endpoint_url=ep, region_name=REGION, config=CONFIG)
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=b'{"state": 1}', ContentType="application/json")
            print(json.dumps({"ok": True}))
        except ClientError as e:
            print(json.dumps({"ok": False, "error": str(e)}))
    elif cmd == "redact":
        ep, bucket, session, store = sys.argv[2:6]
        print(json.dumps(redact(ep, bucket, session, store)))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
