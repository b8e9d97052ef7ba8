"""A real S3-compatible server for the object-storage tests: moto's server mode in a subprocess on 127.0.0.1.

moto checks request signatures only with INITIAL_NO_AUTH_ACTION_COUNT set, and then rejects s3fs's signed
listings even with the right key (it signs the empty `prefix=` query differently); so the server the runs use
accepts any key, and the wrong-credentials test uses a second server with checking on, which rejects a wrong
secret the way AWS does (SignatureDoesNotMatch)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BUCKET = "ember-test"


@dataclass
class S3Server:
    pid: int
    endpoint: str
    key_id: str
    secret: str

    def env(self, **extra: str) -> dict[str, str]:
        """The variables a process reaches the server with (and nothing else of AWS's)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        # moto checks signatures, but not the streaming checksum trailers botocore adds by default
        return {**env, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required", **extra}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(key=self.key_id, secret=self.secret, skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                                 config_kwargs={"request_checksum_calculation": "when_required",
                                                "response_checksum_validation": "when_required"})

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}"

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3_server(folder: Path, check_signatures: bool = False) -> S3Server:
    port = _free_port()
    log = (folder / "moto.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "INITIAL_NO_AUTH_ACTION_COUNT"}
    if check_signatures:  # the IAM user, its key and its policy are made unchecked, then every request is
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return _set_up(proc, folder, port, check_signatures)
    except BaseException:
        proc.kill()  # a server that could not be set up is stopped here, never left running
        raise


def _set_up(proc: subprocess.Popen, folder: Path, port: int, check_signatures: bool) -> S3Server:
    import boto3

    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, (folder / "moto.log").read_text()
            time.sleep(0.1)
    anonymous = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                     aws_secret_access_key="setup")
    iam = boto3.client("iam", **anonymous)
    iam.create_user(UserName="ember")
    key = iam.create_access_key(UserName="ember")["AccessKey"]
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="ember", PolicyName="s3", PolicyDocument=json.dumps(policy))
    server = S3Server(proc.pid, endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    if check_signatures:
        return server
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=server.key_id,
                 aws_secret_access_key=server.secret).create_bucket(Bucket=BUCKET)
    return server
