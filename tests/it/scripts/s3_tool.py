"""One-off S3 operations for the tests, with boto3.

usage:
  s3_tool.py setup STORE BUCKET KEY SEED     create the bucket; put {"messages": []} at KEY
                                             through SEED (a sidecar, or the store)
  s3_tool.py read STORE BUCKET KEY           the object: body, ETag, metadata, content type
  s3_tool.py conditional PROXY BUCKET KEY    put_object with extra headers, then IfMatch= with
                                             the object's ETag and with a stale one
  s3_tool.py private STORE BUCKET -         on a store that checks signatures (moto with
                                             INITIAL_NO_AUTH_ACTION_COUNT=3): an IAM user
                                             allowed s3:*, its access key, and the bucket
  s3_tool.py role STORE BUCKET -            the same (INITIAL_NO_AUTH_ACTION_COUNT=5), the user
                                             allowed sts:* too, and a role allowed s3:* that a
                                             web identity may assume; prints its ARN as well
Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ("testing" by default).
Prints one JSON line.
"""
import json
import os
import sys

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

cmd, endpoint, bucket, key = sys.argv[1:5]
c = boto3.client(
    "s3",
    endpoint_url=endpoint,
    aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
    aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
    region_name="us-east-1",
    config=Config(s3={"addressing_style": "path"}),
)
attempts = {"n": 0}


def count(**_):
    attempts["n"] += 1


c.meta.events.register("before-send.s3.PutObject", count)


def put(**kwargs):
    """put_object: what boto3 returned or raised, and its HTTP attempts."""
    attempts["n"] = 0
    try:
        r = c.put_object(Bucket=bucket, Key=key, **kwargs)
        return {"ok": True, "etag": r.get("ETag"), "status": r["ResponseMetadata"]["HTTPStatusCode"], "attempts": attempts["n"]}
    except ClientError as e:
        return {
            "ok": False,
            "code": e.response["Error"]["Code"],
            "status": e.response["ResponseMetadata"]["HTTPStatusCode"],
            "attempts": attempts["n"],
        }


if cmd in ("private", "role"):
    iam = boto3.client("iam", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    iam.create_user(UserName="agent")
    actions = ["s3:*", "sts:*"] if cmd == "role" else "s3:*"
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
    iam.put_user_policy(UserName="agent", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="agent")["AccessKey"]
    role_arn = None
    if cmd == "role":
        trust = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"Federated": "oidc"}, "Action": "sts:AssumeRoleWithWebIdentity"}],
        }
        role_arn = iam.create_role(RoleName="sidecar", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        s3_only = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_role_policy(RoleName="sidecar", PolicyName="s3", PolicyDocument=json.dumps(s3_only))
    signed = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key["AccessKeyId"],
        aws_secret_access_key=key["SecretAccessKey"],
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    signed.create_bucket(Bucket=bucket)
    print(json.dumps({"key": key["AccessKeyId"], "secret": key["SecretAccessKey"], "role": role_arn}))
elif cmd == "setup":
    c.create_bucket(Bucket=bucket)
    seed = boto3.client(
        "s3",
        endpoint_url=sys.argv[5],
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    seed.put_object(Bucket=bucket, Key=key, Body=b'{"messages": []}', ContentType="application/json")
    print(json.dumps({"ok": True}))
elif cmd == "read":
    r = c.get_object(Bucket=bucket, Key=key)
    print(json.dumps({
        "doc": json.loads(r["Body"].read()),
        "etag": r["ETag"],
        "metadata": r.get("Metadata", {}),
        "content_type": r.get("ContentType"),
        "sse": r.get("ServerSideEncryption"),
    }))
elif cmd == "conditional":
    got = c.get_object(Bucket=bucket, Key=key)
    doc = json.loads(got["Body"].read())
    first_etag = got["ETag"]
    doc["messages"].append({"id": "if-match", "role": "user", "content": "conditional"})
    current = put(Body=json.dumps(doc).encode(), IfMatch=first_etag)
    doc["messages"].append({"id": "stale-if-match", "role": "user", "content": "stale"})
    stale = put(Body=json.dumps(doc).encode(), IfMatch=first_etag)
    got = c.get_object(Bucket=bucket, Key=key)
    doc = json.loads(got["Body"].read())
    doc["messages"].append({"id": "with-headers", "role": "user", "content": "kept headers"})
    with_headers = put(
        Body=json.dumps(doc).encode(),
        ContentType="application/octet-stream",
        Metadata={"owner": "agent-7"},
        ServerSideEncryption="AES256",
    )
    print(json.dumps({"current": current, "stale": stale, "with_headers": with_headers}))
else:
    sys.exit(f"unknown command {cmd}")
