"""Edge cases of S3 through a sidecar, with boto3: writers beside the sidecar, If-None-Match,
subresources and copies, the store's own refusals.

usage: s3_edges.py CASE PROXY STORE BUCKET
  beside          objects turnlock never wrote (absent, legacy), a careful writer straight to
                  the store, and an agent's copy through the sidecar
  if_none_match   IfNoneMatch="*" through the sidecar, on an existing and a new object
  subresources    tagging, ACL, copy_object and a multipart upload through the sidecar
  errors          a missing bucket; a stored object that is not JSON
  spellings       keys that differ from a session's only by an empty segment or a trailing
                  slash: other objects; slashes before the bucket, a parameter S3 ignores:
                  the session's object
  stale_queries   an older turn sent with parameters S3 and its emulators read as a plain
                  PutObject (`?versionId`, `?uploads`, an `?uploadId` without a part
                  number, ...): refused as stale, the newer turn kept
Prints one JSON line: what each step returned or raised, and what the store holds.
"""
import json
import os
import sys

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

case, proxy, store, bucket = sys.argv[1:5]


def client(endpoint):
    c = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    c.attempts = 0

    def count(**_):
        c.attempts += 1

    c.meta.events.register("before-send.s3.*", count)
    return c


p, d = client(proxy), client(store)


def call(c, op, **kwargs):
    """An S3 call: what it returned or raised, with its HTTP attempts."""
    c.attempts = 0
    try:
        r = getattr(c, op)(**kwargs)
        return {"ok": True, "status": r["ResponseMetadata"]["HTTPStatusCode"], "etag": r.get("ETag"), "attempts": c.attempts, "r": {k: v for k, v in r.items() if k in ("UploadId", "ETag", "CopyObjectResult")}}
    except ClientError as e:
        return {"ok": False, "status": e.response["ResponseMetadata"]["HTTPStatusCode"], "code": e.response["Error"].get("Code"), "message": e.response["Error"].get("Message"), "attempts": c.attempts}


def stored(key):
    try:
        return json.loads(d.get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as e:
        return {"missing": e.response["Error"]["Code"]}


def ids(key):
    return [m.get("id") for m in stored(key).get("messages", [])]


def body(doc):
    return json.dumps(doc).encode()


out = {}
if case != "errors":
    d.create_bucket(Bucket=bucket)

if case == "beside":
    # Absent: the agent reads nothing; a careful writer creates the object straight at the store.
    k = "sessions/absent.json"
    out["absent_read"] = call(p, "get_object", Bucket=bucket, Key=k)
    out["absent_direct"] = call(d, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "direct"}]}), IfNoneMatch="*")
    out["absent_agent"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "mine"}]}))
    out["absent_ids"] = ids(k)
    # Legacy: an object turnlock never wrote, changed by a careful writer after the agent's read.
    for name, precondition in [("legacy", None), ("legacy_fresh_tag", "fresh"), ("legacy_stale_tag", "stale")]:
        k = f"sessions/{name}.json"
        d.put_object(Bucket=bucket, Key=k, Body=body({"title": "t", "messages": [{"id": "old"}]}))
        g = p.get_object(Bucket=bucket, Key=k)
        copy = json.loads(g["Body"].read())
        g2 = d.get_object(Bucket=bucket, Key=k)
        theirs = json.loads(g2["Body"].read())
        theirs["messages"].append({"id": "direct"})
        out[name + "_direct"] = call(d, "put_object", Bucket=bucket, Key=k, Body=body(theirs), IfMatch=g2["ETag"])
        copy["messages"].append({"id": "mine"})
        copy["title"] = "mine"
        extra = {}
        if precondition == "stale":
            extra["IfMatch"] = g["ETag"]
        elif precondition == "fresh":
            extra["IfMatch"] = d.head_object(Bucket=bucket, Key=k)["ETag"]
        out[name + "_agent"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body(copy), **extra)
        out[name + "_ids"] = ids(k)
        out[name + "_title"] = stored(k).get("title")
    # Once turnlock wrote it, a copy read through the sidecar carries its version: what the
    # agent leaves out is deleted.
    k = "sessions/legacy.json"
    copy = json.loads(p.get_object(Bucket=bucket, Key=k)["Body"].read())
    copy["messages"] = [m for m in copy["messages"] if m.get("id") != "old"]
    out["known_base_agent"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body(copy))
    out["known_base_ids"] = ids(k)

elif case == "if_none_match":
    k = "sessions/inm.json"
    d.put_object(Bucket=bucket, Key=k, Body=body({"messages": [{"id": "first"}]}))
    out["existing"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "second"}]}), IfNoneMatch="*")
    out["existing_ids"] = ids(k)
    k = "sessions/inm-new.json"
    out["new"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "a"}]}), IfNoneMatch="*")
    out["new_again"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "b"}]}), IfNoneMatch="*")
    out["new_ids"] = ids(k)

elif case == "subresources":
    k = "sessions/sub.json"
    out["put"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "a"}]}))
    out["tagging"] = call(p, "put_object_tagging", Bucket=bucket, Key=k, Tagging={"TagSet": [{"Key": "t", "Value": "v"}]})
    out["tags"] = d.get_object_tagging(Bucket=bucket, Key=k)["TagSet"]
    out["acl"] = call(p, "put_object_acl", Bucket=bucket, Key=k, ACL="public-read")
    d.put_object(Bucket=bucket, Key="other/src.json", Body=body({"messages": [{"id": "fromcopy"}]}))
    out["copy"] = call(p, "copy_object", Bucket=bucket, Key=k, CopySource={"Bucket": bucket, "Key": "other/src.json"})
    out["after_copy"] = stored(k)
    k = "sessions/mp.json"
    d.put_object(Bucket=bucket, Key=k, Body=body({"messages": [{"id": "orig"}]}))
    uid = p.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]
    out["part"] = call(p, "upload_part", Bucket=bucket, Key=k, UploadId=uid, PartNumber=1, Body=body({"messages": [{"id": "part"}]}))
    out["during_upload"] = stored(k)
    out["complete"] = call(p, "complete_multipart_upload", Bucket=bucket, Key=k, UploadId=uid, MultipartUpload={"Parts": [{"ETag": out["part"]["etag"], "PartNumber": 1}]})
    out["after_upload"] = stored(k)

elif case == "spellings":
    k = "sessions/k.json"
    out["session"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"turn": 1, "messages": [{"id": "keep"}]}))
    for name, other in [("double", "sessions//k.json"), ("trailing", "sessions/k.json/"), ("dot", "sessions/./k.json")]:
        out[name] = call(p, "put_object", Bucket=bucket, Key=other, Body=body({"other": name}))
        out[name + "_stored"] = stored(other)
    # `//bucket/key` (no SDK sends it; S3 reads it as bucket/key), sent byte for byte.
    import http.client
    import urllib.parse
    u = urllib.parse.urlparse(proxy)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    auth = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00"
    conn.request("PUT", f"//{bucket}/{k}", body=body({"turn": 1, "messages": [{"id": "slashes"}]}),
                 headers={"Authorization": auth, "Content-Type": "application/json"})
    r = conn.getresponse()
    out["leading_slashes"] = {"status": r.status, "body": r.read().decode(errors="replace")}
    # A query parameter S3 ignores (a cache buster): still a PutObject of the session's object.
    conn.request("PUT", f"/{bucket}/{k}?cb=1", body=body({"turn": 1, "messages": [{"id": "query"}]}),
                 headers={"Authorization": auth, "Content-Type": "application/json"})
    r = conn.getresponse()
    out["ignored_query"] = {"status": r.status, "body": r.read().decode(errors="replace")}
    out["session_stored"] = stored(k)

elif case == "stale_queries":
    import http.client
    import urllib.parse
    k = "sessions/stale.json"
    out["newer"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"turn": 2, "messages": [{"id": "newer"}]}))
    u = urllib.parse.urlparse(proxy)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    auth = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00"
    for query in ["versionId=x", "uploads", "uploadId=x", "partNumber=1", "uploadId=&partNumber=1",
                  "torrent", "restore", "select", "attributes", "renameObject"]:
        conn.request("PUT", f"/{bucket}/{k}?{query}", body=body({"turn": 1, "messages": [{"id": query}]}),
                     headers={"Authorization": auth, "Content-Type": "application/json"})
        r = conn.getresponse()
        out["older?" + query] = {"status": r.status, "body": r.read().decode(errors="replace")}
    out["stored"] = stored(k)

elif case == "errors":
    out["no_bucket_direct"] = call(d, "put_object", Bucket=bucket + "-missing", Key="sessions/x.json", Body=body({"messages": []}))
    out["no_bucket"] = call(p, "put_object", Bucket=bucket + "-missing", Key="sessions/x.json", Body=body({"messages": []}))
    d.create_bucket(Bucket=bucket)
    k = "sessions/text.json"
    d.put_object(Bucket=bucket, Key=k, Body=b"plain text, not JSON")
    out["not_json"] = call(p, "put_object", Bucket=bucket, Key=k, Body=body({"messages": [{"id": "a"}]}))

print(json.dumps(out, default=str))
