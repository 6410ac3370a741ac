"""GET-modify-PUT session agents on S3, driven with boto3 as agent code drives it.

Each agent, for each of its writes: get_object the session document, append one message with
its own id, and put_object the whole document back (boto3's defaults: no content type, no
precondition, checksums, retries). Agents are spread over the endpoints given (sidecars, or
the store itself). Prints one JSON line: the ids of the writes boto3 reported as done, the
errors it raised, and how many HTTP attempts each put_object took beyond the first.

usage: s3_agents.py ENDPOINTS BUCKET KEY AGENTS WRITES [--if-match]
"""
import json
import os
import random
import sys
import threading
import time

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

endpoints = sys.argv[1].split(",")
bucket, key = sys.argv[2], sys.argv[3]
agents, writes = int(sys.argv[4]), int(sys.argv[5])
if_match = "--if-match" in sys.argv[6:]

lock = threading.Lock()
acked, errors = [], []
extra_attempts = [0]


def client(endpoint):
    c = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    attempts = threading.local()

    def count(request, **_):
        # Called once per HTTP attempt of a PutObject: a second call is a retry.
        n = getattr(attempts, "n", 0) + 1
        attempts.n = n
        if n > 1:
            with lock:
                extra_attempts[0] += 1

    c.meta.events.register("before-send.s3.PutObject", count)
    return c, attempts


def agent(i):
    c, attempts = client(endpoints[i % len(endpoints)])
    rng = random.Random(i)
    for k in range(writes):
        mid = f"a{i}-{k}"
        try:
            got = c.get_object(Bucket=bucket, Key=key)
            etag = got["ETag"]
            doc = json.loads(got["Body"].read())
            doc.setdefault("messages", []).append({"id": mid, "role": "user", "content": f"agent {i} write {k}"})
            time.sleep(rng.random() * 0.004)
            attempts.n = 0
            kwargs = {"IfMatch": etag} if if_match else {}
            if i % 2:
                # Half the agents declare the type boto3 users often set; the others none.
                kwargs["ContentType"] = "binary/octet-stream"
            c.put_object(
                Bucket=bucket,
                Key=key,
                Body=json.dumps(doc).encode(),
                Metadata={"agent": str(i)},
                **kwargs,
            )
            with lock:
                acked.append(mid)
        except ClientError as e:
            with lock:
                errors.append({"id": mid, "code": e.response["Error"]["Code"], "status": e.response["ResponseMetadata"]["HTTPStatusCode"]})
        except Exception as e:  # noqa: BLE001 - any other failure is reported, not hidden
            with lock:
                errors.append({"id": mid, "code": type(e).__name__, "status": 0, "message": str(e)})


threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=120)
print(json.dumps({"acked": acked, "errors": errors, "extra_attempts": extra_attempts[0]}))
