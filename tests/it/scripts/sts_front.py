"""A stand-in for AWS STS's public endpoint, in front of moto's STS.

AWS takes AssumeRoleWithWebIdentity unsigned (the web identity token is the credential);
moto, once it checks signatures, wants every call signed. This front takes the sidecar's
unsigned call as AWS would, records the token it carried, asks for credentials that live
DURATION seconds, signs the call with KEY/SECRET (a user moto knows) and relays moto's answer.

usage: sts_front.py MOTO_URL PORT LOG KEY SECRET DURATION
LOG gets one JSON line per call: {"token": ..., "role": ..., "status": ...}.
"""
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

moto, port, log, key, secret, duration = sys.argv[1:7]
creds = Credentials(key, secret)


class Front(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        form = urllib.parse.parse_qs(self.rfile.read(length).decode())
        fields = {k: v[0] for k, v in form.items()}
        fields["DurationSeconds"] = duration
        body = urllib.parse.urlencode(fields)
        request = AWSRequest(
            method="POST",
            url=moto + "/",
            data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        SigV4Auth(creds, "sts", "us-east-1").add_auth(request)
        try:
            with urllib.request.urlopen(
                urllib.request.Request(moto + "/", data=body.encode(), headers=dict(request.headers), method="POST")
            ) as r:
                status, answer = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, answer = e.code, e.read()
        with open(log, "a") as f:
            f.write(json.dumps({"token": fields.get("WebIdentityToken"), "role": fields.get("RoleArn"), "status": status}) + "\n")
        self.send_response(status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(port)), Front).serve_forever()
