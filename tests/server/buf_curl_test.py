#!/usr/bin/python3
"""The server through `buf curl`, a generic gRPC client that learns every schema by reflection.

Starts the attnserve binary on an ephemeral loopback port and, with buf curl (npm package
@bufbuild/buf, installed under the build tree on first use), over each reflection protocol
(grpc.reflection.v1 and v1alpha): lists the services and their methods, describes each service
through reflection, and calls grpc.health.v1.Health/Check, GetServerInfo and an Attend written as
JSON (tensors as base64 bytes) whose O and LSE are checked against a float64 reference. Then the
same against a server with TLS (a throw-away self-signed certificate) and a bearer token: calls
without the token, or with a wrong one, fail UNAUTHENTICATED while health and reflection stay open.

Usage: buf_curl_test.py ATTNSERVE_BINARY NPM_DIR
Exits 77 (skipped) when npm is missing or the npm registry cannot be reached.
"""
import base64
import json
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

BUF_VERSION = "1.75.0"  # the version this test was written against; a different one is replaced
PROTOCOLS = ("grpc-v1", "grpc-v1alpha")
SERVICES = {
    "attnserve.v1.AttentionService": {"Attend", "AttendBackward", "AttendStream", "GetServerInfo",
                                      "RegisterSharedMemory", "UnregisterSharedMemory",
                                      "CreateSession", "GetSession", "ListSessions",
                                      "DeleteSession", "AppendKV"},
    "attnserve.v1.TrainingService": {"SubmitTrainingJob", "GetTrainingJob", "ListTrainingJobs",
                                     "WatchTrainingJob", "CancelTrainingJob", "GetTrainingResult"},
    "grpc.health.v1.Health": {"Check", "Watch"},
    "grpc.reflection.v1.ServerReflection": {"ServerReflectionInfo"},
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo"},
}
TOKEN = "buf-curl-test-token"


def skip(why):
    print(f"skipped: {why}")
    sys.exit(77)


def install_buf(npm_dir):
    """The buf binary under npm_dir, installed there with npm when missing or of another version."""
    buf = os.path.join(npm_dir, "node_modules", ".bin", "buf")
    if os.path.exists(buf):
        version = subprocess.run([buf, "--version"], capture_output=True, text=True, timeout=60)
        if version.returncode == 0 and version.stdout.strip() == BUF_VERSION:
            return buf
    npm = shutil.which("npm")
    if npm is None:
        skip("npm is not installed (deploy/install-deps.sh installs it); buf curl comes from npm")
    npm_args = ["--prefix", npm_dir, "--cache", os.path.join(npm_dir, "cache"), "--no-audit",
                "--no-fund", "--no-update-notifier", "--loglevel=error"]
    # One quick question first, so that an unreachable registry is a skip within seconds rather
    # than a failure after npm install's minutes of retries.
    try:
        ping = subprocess.run([npm, "ping", *npm_args, "--fetch-retries=1"], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        skip("the npm registry did not answer npm ping within 120 s, so buf curl cannot be installed")
    if ping.returncode != 0:
        reason = [line for line in ping.stderr.splitlines() if "error" in line][:2]
        skip(f"the npm registry is unreachable, so buf curl cannot be installed "
             f"(npm ping: {' / '.join(reason)})")
    # The package's own shim finds its platform binary; its install script is not needed.
    install = subprocess.run(
        [npm, "install", *npm_args, "--ignore-scripts", f"@bufbuild/buf@{BUF_VERSION}"],
        capture_output=True, text=True, timeout=300)
    if install.returncode != 0:
        sys.exit(f"npm install @bufbuild/buf@{BUF_VERSION} failed with the registry reachable:\n"
                 f"{install.stderr}")
    return buf


class Server:
    """attnserve on 127.0.0.1:0; the port comes back through --port_file."""

    def __init__(self, binary, workdir, flags):
        self.port_file = os.path.join(workdir, "port")
        self.log_path = os.path.join(workdir, "server.log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", f"--port_file={self.port_file}", "--cpu_threads=1",
             *flags], stderr=self.log)
        deadline = time.time() + 20
        while not os.path.exists(self.port_file):
            if time.time() > deadline or self.process.poll() is not None:
                self.process.kill()
                sys.exit(f"the server did not start:\n{open(self.log_path).read()}")
            time.sleep(0.05)
        self.port = int(open(self.port_file).read())

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=30)
        self.log.close()
        os.remove(self.port_file)
        assert code == 0, f"server exit status {code}:\n{open(self.log_path).read()}"


class BufCurl:
    """buf curl against one server, learning schemas over one reflection protocol."""

    def __init__(self, buf, base_url, protocol, tls_args=(), headers=()):
        self.buf = buf
        self.base_url = base_url
        self.args = ["curl", "--protocol", "grpc", "--reflect-protocol", protocol, *tls_args]
        if base_url.startswith("http:"):
            self.args.append("--http2-prior-knowledge")
        for header in headers:
            self.args += ["-H", header]

    def run(self, *args, url=None):
        return subprocess.run([self.buf, *self.args, *args, url or self.base_url],
                              capture_output=True, text=True, timeout=60)

    def lines(self, *args):
        result = self.run(*args)
        assert result.returncode == 0, f"buf curl {' '.join(args)}: {result.stderr}"
        return result.stdout.split()

    def call(self, method, request=None, headers=()):
        """The JSON responses of one call; raises CallFailed with the gRPC code on an error."""
        args = [] if request is None else ["-d", request]
        for header in headers:
            args += ["-H", header]
        result = self.run(*args, url=f"{self.base_url}/{method}")
        if result.returncode != 0:
            raise CallFailed(method, result)
        return list(json_documents(result.stdout))


class CallFailed(Exception):
    def __init__(self, method, result):
        self.code = None
        try:  # buf curl prints a failed RPC's status as JSON on stderr
            self.code = json.loads(result.stderr[result.stderr.index("{"):])["code"]
        except (ValueError, KeyError):
            pass
        super().__init__(f"{method}: exit {result.returncode}: {result.stderr.strip()}")


def json_documents(text):
    decoder = json.JSONDecoder()
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return
        document, i = decoder.raw_decode(text, i)
        yield document


def check_listing(curl):
    services = set(curl.lines("--list-services"))
    assert services == set(SERVICES), f"services listed: {sorted(services)}"
    # buf curl leaves out, without a word, a listed service it cannot describe.
    methods = set(curl.lines("--list-methods"))
    wanted = {f"{s}/{m}" for s, ms in SERVICES.items() for m in ms}
    assert methods == wanted, f"methods missing: {sorted(wanted - methods)}, " \
                              f"unexpected: {sorted(methods - wanted)}"


def check_described(curl, protocol, descriptor_pb2):
    """Asks the reflection service itself for the file that defines each listed service."""
    package = protocol.replace("grpc-", "grpc.reflection.")
    requests = "".join(json.dumps({"fileContainingSymbol": s}) for s in sorted(SERVICES))
    answers = curl.call(f"{package}.ServerReflection/ServerReflectionInfo", requests)
    assert len(answers) == len(SERVICES), answers
    for service, answer in zip(sorted(SERVICES), answers):
        assert "fileDescriptorResponse" in answer, f"{service} over {package}: {answer}"
        files = [descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(f))
                 for f in answer["fileDescriptorResponse"]["fileDescriptorProto"]]
        # Where the file stands among those sent is not fixed: gRPC 1.51's v1alpha service puts
        # the files of earlier answers on the same stream first.
        package_name, _, service_name = service.rpartition(".")
        (defining,) = [f for f in files if f.package == package_name
                       for s in f.service if s.name == service_name]
        defined = {m.name for s in defining.service if s.name == service_name for m in s.method}
        assert defined == SERVICES[service], f"{service} over {package}: methods {defined}"
        missing = {d for f in files for d in f.dependency} - {f.name for f in files}
        assert not missing, f"{service}: imports not sent: {missing}"
        print(f"  described {service}: {defining.name}, methods {sorted(defined)}")


def attention_reference(q, k, v, seqlen, heads, head_dim, causal):
    """float64 O [seqlen, heads, head_dim] and LSE [heads, seqlen] of one dense sequence."""
    o = [[[0.0] * head_dim for _ in range(heads)] for _ in range(seqlen)]
    lse = [[0.0] * seqlen for _ in range(heads)]
    scale = 1.0 / math.sqrt(head_dim)
    for h in range(heads):
        for i in range(seqlen):
            keys = range(i + 1) if causal else range(seqlen)
            s = [scale * sum(q[i][h][c] * k[j][h][c] for c in range(head_dim)) for j in keys]
            m = max(s)
            p = [math.exp(x - m) for x in s]
            total = sum(p)
            lse[h][i] = m + math.log(total)
            for c in range(head_dim):
                o[i][h][c] = sum(pj * v[j][h][c] for pj, j in zip(p, keys)) / total
    return o, lse


def check_attend(curl, headers=()):
    """A float32 [batch 1, seqlen 4, heads 2, head_dim 8] causal request with the LSE."""
    seqlen, heads, head_dim = 4, 2, 8
    rng = random.Random(22)
    tensors = {}
    for name in "qkv":
        values = [[[rng.uniform(-2, 2) for _ in range(head_dim)] for _ in range(heads)]
                  for _ in range(seqlen)]
        # Rounded to float32 first, so the reference sees exactly what the server does.
        flat = struct.unpack(f"<{seqlen * heads * head_dim}f",
                             struct.pack(f"<{seqlen * heads * head_dim}f",
                                         *[x for row in values for head in row for x in head]))
        it = iter(flat)
        tensors[name] = [[[next(it) for _ in range(head_dim)] for _ in range(heads)]
                         for _ in range(seqlen)]
    request = {"requestId": "buf-curl", "causal": True, "returnLse": True}
    for name, values in tensors.items():
        flat = [x for row in values for head in row for x in head]
        request[name] = {"dtype": "DTYPE_FLOAT32", "shape": [1, seqlen, heads, head_dim],
                         "data": base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode()}
    (response,) = curl.call("attnserve.v1.AttentionService/Attend", json.dumps(request), headers)
    assert response["requestId"] == "buf-curl", response
    assert response["o"]["dtype"] == "DTYPE_FLOAT32", response["o"]
    assert [int(d) for d in response["o"]["shape"]] == [1, seqlen, heads, head_dim], response["o"]
    o = struct.unpack(f"<{seqlen * heads * head_dim}f", base64.b64decode(response["o"]["data"]))
    lse = struct.unpack(f"<{heads * seqlen}f", base64.b64decode(response["lse"]["data"]))
    o_ref, lse_ref = attention_reference(tensors["q"], tensors["k"], tensors["v"], seqlen, heads,
                                         head_dim, causal=True)
    o_err = max(abs(a - b) for a, b in zip(o, [x for row in o_ref for hd in row for x in hd]))
    lse_err = max(abs(a - b) for a, b in zip(lse, [x for row in lse_ref for x in row]))
    assert o_err < 1e-5 and lse_err < 1e-5, f"max |dO| {o_err}, max |dLSE| {lse_err}"
    print(f"  Attend on {response['engine']}: max |dO| {o_err:.1e}, max |dLSE| {lse_err:.1e}")


def check_calls(curl, headers=()):
    for service in ("", "attnserve.v1.AttentionService", "attnserve.v1.TrainingService"):
        (reply,) = curl.call("grpc.health.v1.Health/Check", json.dumps({"service": service}))
        assert reply == {"status": "SERVING"}, f"health of {service!r}: {reply}"
    (info,) = curl.call("attnserve.v1.AttentionService/GetServerInfo", "{}", headers)
    assert "cpu_tiled" in info["engines"], info
    assert int(info["limits"]["maxMessageBytes"]) > 4 * 1024 * 1024, info["limits"]
    print(f"  health SERVING; GetServerInfo: version {info['version']}, engines {info['engines']}")
    check_attend(curl, headers)
    return info


def check_refused(curl, headers):
    try:
        curl.call("attnserve.v1.AttentionService/GetServerInfo", "{}", headers)
    except CallFailed as e:
        assert e.code == "unauthenticated", e
        return
    raise AssertionError(f"GetServerInfo with headers {list(headers)} was answered")


def main():
    binary, npm_dir = sys.argv[1], sys.argv[2]
    try:
        from google.protobuf import descriptor_pb2
    except ImportError as e:  # Debian: apt-get install python3-protobuf
        skip(f"{e} (reading the descriptors reflection returns)")
    if shutil.which("openssl") is None:
        skip("openssl is not installed (the TLS half makes its certificate with it)")
    buf = install_buf(npm_dir)
    print(f"buf {BUF_VERSION}: {buf}")
    workdir = tempfile.mkdtemp(prefix="attnserve_buf_curl_")
    try:
        server = Server(binary, workdir, [])
        try:
            for protocol in PROTOCOLS:
                print(f"plaintext, reflection over {protocol}:")
                curl = BufCurl(buf, f"http://127.0.0.1:{server.port}", protocol)
                check_listing(curl)
                check_described(curl, protocol, descriptor_pb2)
                check_calls(curl)
        finally:
            server.stop()

        cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", cert],
                       check=True, capture_output=True, timeout=60)
        token_file = os.path.join(workdir, "token")
        with open(token_file, "w") as f:
            f.write(f"{TOKEN}\n")
        server = Server(binary, workdir, [f"--tls_cert_file={cert}", f"--tls_key_file={key}",
                                          f"--auth_token_file={token_file}"])
        try:
            print("TLS and a bearer token, reflection over grpc-v1:")
            curl = BufCurl(buf, f"https://127.0.0.1:{server.port}", "grpc-v1", ["--cacert", cert])
            check_listing(curl)  # reflection and health need no token
            check_refused(curl, [])
            check_refused(curl, ["authorization: Bearer not-the-token"])
            print("  without the token, or with a wrong one: UNAUTHENTICATED")
            info = check_calls(curl, [f"authorization: Bearer {TOKEN}"])
            assert info.get("authRequired") is True, info
            plaintext = BufCurl(buf, f"http://127.0.0.1:{server.port}", "grpc-v1")
            assert plaintext.run("--list-services").returncode != 0, "plaintext was answered"
            print("  a plaintext client is refused")
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
