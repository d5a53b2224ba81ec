#!/usr/bin/python3
"""KV sessions through a real proxy: two attnserve servers on loopback behind nginx or HAProxy,
run with the committed configuration (deploy/nginx/, deploy/haproxy/) with only its upstream
addresses and listen port rewritten.

    run_tests.py ATTNSERVE_BINARY --venv DIR --run proxy_sessions_test.py --proxy=nginx REPO_ROOT

(ctest's proxy_sessions_nginx and proxy_sessions_haproxy; the attnserve package must be
installed, as run_tests.py does.) Through the proxy, with the Python client's route=:
  * calls without the routing header spread over both servers;
  * sessions created with different route keys, each filled by appends of odd sizes and stepped
    with decode steps (answers against the float64 reference), spread over both servers; asked
    directly, each server lists its own, each session lives on exactly one server holding every
    token appended through the proxy, and the proxy's log shows every call of a route key
    answered by that one server;
  * a session's id sent with a route key that maps to the other server, an unknown id, and
    another identity's session are NOT_FOUND alike;
  * a server restarted on its port has lost its sessions (NOT_FOUND); the other server's still
    answer; a session created anew with the same route lands on the restarted server;
  * a 192 MiB AppendKV message and a 96 MiB Attend answer pass the proxy.
Exits 77 (skipped) only when the proxy's binary is not installed or cannot start.
"""
import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

SKIP = 77
ROOT_DEFAULT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALICE, BOB = "tok-alice-proxy-0001", "tok-bob-proxy-00001"
# HAProxy 2.6 (Debian 12) answers a client-streamed call that the server ends before the client
# has finished sending (an AppendKV refused on its first chunk) with RST_STREAM CANCEL instead of
# passing the server's status on: haproxy/haproxy#1219, and the reason docs/deployment.md
# recommends nginx for sessions.
HAPROXY_STREAM_STATUS = "HAProxy's known loss of an early-ended stream's status, haproxy#1219"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find(name):
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)


class Proxy:
    """The proxy process with the repository's config, upstreams and port rewritten."""

    def __init__(self, kind, root, work, upstream_ports):
        self.kind, self.work = kind, work
        self.port = free_port()
        self.log_path = os.path.join(work, f"{kind}-calls.log")
        self.err_path = os.path.join(work, f"{kind}-errors.log")
        # haproxy logs calls to its stdout; nginx to a file of its own (_nginx).
        self.out_path = self.log_path if kind == "haproxy" else os.path.join(work, "nginx-out.log")
        if kind == "nginx":
            self.command = self._nginx(root, upstream_ports)
        else:
            self.command = self._haproxy(root, upstream_ports)

    def _nginx(self, root, ports):
        conf = open(os.path.join(root, "deploy/nginx/attnserve-sessions.conf")).read()
        upstream = re.search(r"upstream attnserve \{.*?\n\}", conf, re.S).group(0)
        servers = re.findall(r"^\s*server\s+\S+;$", upstream, re.M)
        assert len(servers) == 2, f"attnserve-sessions.conf: 2 upstream servers expected: {servers}"
        for line, port in zip(servers, ports):
            upstream = upstream.replace(line, f"    server 127.0.0.1:{port};")
        conf = conf.replace(re.search(r"upstream attnserve \{.*?\n\}", conf, re.S).group(0),
                            upstream)
        conf, n = re.subn(r"listen\s+50051\s+http2;", f"listen 127.0.0.1:{self.port} http2;",
                          conf)
        assert n == 1, "attnserve-sessions.conf: one `listen 50051 http2;` expected"
        open(os.path.join(self.work, "attnserve-sessions.conf"), "w").write(conf)
        # The access log goes to a file here rather than /dev/stdout, which is not the process's
        # stdout on every machine (one build machine had a regular file of that name).
        main = open(os.path.join(root, "deploy/nginx/nginx.conf")).read()
        main, n = re.subn(r"access_log\s+/dev/stdout\s+attnserve;",
                          f"access_log {self.log_path} attnserve;", main)
        assert n == 1, "nginx.conf: one `access_log /dev/stdout attnserve;` expected"
        open(os.path.join(self.work, "nginx.conf"), "w").write(main)
        os.chmod(self.work, 0o755)  # nginx's workers drop to `nobody` when started as root
        prefix = self.work + "/"
        return [find("nginx"), "-p", prefix, "-c", prefix + "nginx.conf", "-e", "stderr", "-g",
                "daemon off;"]

    def _haproxy(self, root, ports):
        cfg = open(os.path.join(root, "deploy/haproxy/attnserve-sessions.cfg")).read()
        servers = re.findall(r"^(\s*server\s+\S+\s+)(\S+:50051)", cfg, re.M)
        assert len(servers) == 2, f"attnserve-sessions.cfg: 2 servers expected: {servers}"
        for (head, address), port in zip(servers, ports):
            cfg = cfg.replace(head + address, f"{head}127.0.0.1:{port}")
        cfg, n = re.subn(r"bind :50051 ", f"bind 127.0.0.1:{self.port} ", cfg)
        assert n == 1, "attnserve-sessions.cfg: one `bind :50051` expected"
        path = os.path.join(self.work, "haproxy.cfg")
        open(path, "w").write(cfg)
        return [find("haproxy"), "-db", "-f", path]

    def start(self):
        """True once it accepts connections; False when it exited (the error log says why)."""
        self.proc = subprocess.Popen(self.command, stdout=open(self.out_path, "wb"),
                                     stderr=open(self.err_path, "wb"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def errors(self):
        return open(self.err_path, errors="replace").read()

    def calls(self, expected):
        """(route key, upstream port) of each call the proxy logged; "-" for no header.

        A call is logged as it ends, which on a loaded machine can be seconds after the client
        saw its reply: the log is read again until it holds `expected` calls or 15 s pass."""
        deadline = time.monotonic() + 15
        while True:
            text = open(self.log_path, errors="replace").read()
            logged = [(m.group(1), int(m.group(2))) for m in
                      re.finditer(r'route="?([^" ]*)"? upstream=127\.0\.0\.1:(\d+)', text)]
            if len(logged) >= expected or time.monotonic() > deadline:
                return logged
            time.sleep(0.1)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Check:
    def __init__(self):
        self.failures = []
        self.passed = 0

    def __call__(self, condition, message):
        if condition:
            self.passed += 1
        else:
            self.failures.append(message)
            print("FAIL:", message)
        return condition


def not_found(call):
    """The AttnServeError code and message of a call expected to fail, or ("OK", "")."""
    import attnserve
    try:
        call()
    except attnserve.AttnServeError as e:
        return e.code.name, e.message
    return "OK", ""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--proxy", choices=("nginx", "haproxy"), required=True)
    parser.add_argument("root", nargs="?", default=ROOT_DEFAULT)
    args = parser.parse_args()
    if not find(args.proxy):
        print(f"SKIP: no {args.proxy} binary on PATH or in /usr/sbin (deploy/install-deps.sh "
              f"installs Debian's {args.proxy} package)")
        return SKIP
    binary = os.environ["ATTNSERVE_BINARY"]
    sys.path.insert(0, os.path.join(args.root, "tests/clients"))
    import attnserve
    from reference import TOLERANCE, assert_close, attention, max_error, rounded
    from servers import Server

    check = Check()
    work = tempfile.mkdtemp(prefix=f"attnserve-{args.proxy}-")
    tokens_file = os.path.join(work, "tokens")
    with open(tokens_file, "w") as f:
        f.write(f"alice {ALICE}\nbob {BOB}\n")
    flags = (f"--auth_token_file={tokens_file}",)
    servers = [Server(binary, *flags), Server(binary, *flags)]
    ports = [int(s.target.rsplit(":", 1)[1]) for s in servers]
    proxy = Proxy(args.proxy, args.root, work, ports)
    if not proxy.start():
        print(f"SKIP: {args.proxy} did not start:\n{proxy.errors()}")
        for s in servers:
            s.stop()
        return SKIP
    print(f"{args.proxy} on 127.0.0.1:{proxy.port} in front of servers A (:{ports[0]}) and "
          f"B (:{ports[1]})")
    target = f"127.0.0.1:{proxy.port}"
    rng = np.random.default_rng(16)
    dtype, kv_heads, heads, head_dim = "bfloat16", 2, 8, 32
    tol = TOLERANCE[dtype]

    def rows(n, h):
        return rng.uniform(-1, 1, (n, h, head_dim)).astype(np.float32)

    directs = [attnserve.Client(s.target, token=ALICE, timeout=60) for s in servers]

    def direct(i):
        """Server i itself, not through the proxy (a restarted server is reached again)."""
        return directs[i]

    def where(session_id):
        return [i for i in (0, 1) if session_id in {x.session_id for x in direct(i).sessions()}]

    try:
        c = attnserve.Client(target, token=ALICE, timeout=60)
        # Calls without the header are balanced.
        before = [direct(i).info().stats.requests_completed for i in (0, 1)]
        q = rows(4, heads)[None]
        for _ in range(8):
            c.attend(q, q[:, :, :kv_heads], q[:, :, :kv_heads])
        time.sleep(0.2)  # the server counts a request just after answering it
        spread = [direct(i).info().stats.requests_completed - before[i] for i in (0, 1)]
        print(f"8 stateless calls without the header: A {spread[0]}, B {spread[1]}")
        check(sum(spread) == 8 and min(spread) > 0, f"stateless calls not spread: {spread}")

        # Sessions by route key, appends of odd sizes, decode steps checked against float64.
        sessions, history, calls = {}, {}, {}
        worst = 0.0
        key_index = 0
        while key_index < 12 or min(sum(where_[1] == i for where_ in sessions.values())
                                    for i in (0, 1)) < 2:
            if key_index == 48:
                break
            key = f"conversation-{key_index}"
            key_index += 1
            s = c.session(kv_heads, head_dim, dtype, route=key)
            k = v = np.zeros((0, kv_heads, head_dim), np.float32)
            for n, chunk in ((1 + 13 * (key_index % 5), 7), (17, None)):
                kn, vn = rows(n, kv_heads), rows(n, kv_heads)
                s.append(kn, vn, chunk_tokens=chunk)
                k, v = np.concatenate([k, kn]), np.concatenate([v, vn])
            for _ in range(3):
                q, kn, vn = rows(1, heads), rows(1, kv_heads), rows(1, kv_heads)
                o, lse = s.attend(q, append_k=kn, append_v=vn, causal=True, return_lse=True)
                k, v = np.concatenate([k, kn]), np.concatenate([v, vn])
                want_o, want_lse = attention(*(rounded(x, dtype)[None] for x in (q, k, v)),
                                             causal=True)
                assert_close(f"{key} o", o, want_o[0], tol)
                assert_close(f"{key} lse", lse, want_lse, tol)
                worst = max(worst, max_error(o, want_o[0]))
            info = s.info()
            calls[key] = 1 + 2 + 3 + 1  # create, appends, steps, info
            home = where(s.id)
            check(len(home) == 1, f"{key}: session {s.id} lives on servers {home}")
            sessions[key] = (s, home[0] if home else -1)
            history[key] = len(k)
            check(info.tokens == len(k), f"{key}: {info.tokens} tokens, {len(k)} appended")
        per_server = [sorted(k for k, (_, i) in sessions.items() if i == j) for j in (0, 1)]
        print(f"{len(sessions)} sessions through the proxy: {len(per_server[0])} on A, "
              f"{len(per_server[1])} on B; {3 * len(sessions)} decode steps against the float64 "
              f"reference: max |O - ref| {worst:.2g} (bfloat16 tolerance {tol})")
        check(min(len(p) for p in per_server) >= 2, f"sessions not spread: {per_server}")
        # Each server, asked directly, holds exactly its own sessions with every token.
        for j in (0, 1):
            held = {x.session_id: x.tokens for x in direct(j).sessions()}
            mine = {sessions[k][0].id: history[k] for k in per_server[j]}
            check(held == mine, f"server {'AB'[j]} holds {held}, expected {mine}")

        # The proxy's record: every call of a route key went to that key's server.
        logged = proxy.calls(expected=sum(calls.values()))
        by_key = {}
        for key, port in logged:
            by_key.setdefault(key, []).append(port)
        stray = {k: sorted(set(p)) for k, p in by_key.items()
                 if k in sessions and set(p) != {ports[sessions[k][1]]}}
        counts_ok = all(len(by_key.get(k, [])) == calls[k] for k in sessions)
        print(f"proxy log: {sum(len(by_key.get(k, [])) for k in sessions)} calls of "
              f"{len(sessions)} route keys, each key on one server: {not stray}; calls without "
              f"the header: {len(by_key.get('-', []))}")
        check(not stray, f"route keys answered by more than their server: {stray}")
        check(counts_ok, "the proxy logged a different number of calls per key: " +
              str({k: (len(by_key.get(k, [])), calls[k]) for k in sessions}))

        # Wrong route, unknown id, another identity: NOT_FOUND alike.
        key_a, key_b = per_server[0][0], per_server[1][0]
        s_a = sessions[key_a][0]
        created = s_a.info()
        wrong = attnserve.Session(c, created, key_b)  # A's session, B's route key
        unknown = attnserve.Session(c, dataclasses.replace(created, session_id="0" * 32), key_a)
        bob = attnserve.Client(target, token=BOB, timeout=60)
        foreign = attnserve.Session(bob, created, key_a)
        outcomes = {
            "wrong route: info": not_found(wrong.info),
            "wrong route: attend": not_found(lambda: wrong.attend(rows(1, heads))),
            "wrong route: append": not_found(lambda: wrong.append(rows(1, kv_heads),
                                                                  rows(1, kv_heads))),
            "unknown id: attend": not_found(lambda: unknown.attend(rows(1, heads))),
            "another identity: attend": not_found(lambda: foreign.attend(rows(1, heads))),
            "another identity: delete": not_found(foreign.delete),
        }
        for what, (code, message) in list(outcomes.items()):
            known = (args.proxy == "haproxy" and what == "wrong route: append"
                     and code == "CANCELLED")
            print(f"{what}: {code} {message!r}" + (f" ({HAPROXY_STREAM_STATUS})" if known else ""))
            if known:
                del outcomes[what]
            else:
                check(code == "NOT_FOUND", f"{what}: {code} {message}")
        check(len({m for _, m in outcomes.values()}) == 1,
              "NOT_FOUND messages differ: ids could be probed")
        check(s_a.info().tokens == history[key_a], f"{key_a} changed by the refused calls")
        no_route = attnserve.Session(c, created, None)
        answers = [not_found(no_route.info)[0] for _ in range(8)]
        print(f"the same session without the header, 8 times: {answers.count('OK')} OK, "
              f"{answers.count('NOT_FOUND')} NOT_FOUND")
        check(answers.count("OK") > 0 and answers.count("NOT_FOUND") > 0,
              f"without the header: {answers}")

        # Large messages in both directions, through the proxy.
        n = 48 << 10  # 48 Ki tokens x 8 x 128 x fp16 = 96 MiB of K and as much of V
        kv = np.ones((n, 8, 128), np.float16)
        t_append = {}
        for name, via in (("the proxy", c), ("directly", direct(sessions[key_a][1]))):
            with via.session(8, 128, "float16", route=key_a) as big:
                t0 = time.perf_counter()
                check(big.append(kv, kv, chunk_tokens=n).tokens == n, f"192 MiB append {name}")
                t_append[name] = time.perf_counter() - t0
        # 48 Ki query rows over one key: each row's answer is that key's V row, all ones.
        q = rng.uniform(-1, 1, (n, 8, 128)).astype(np.float16)
        with c.session(8, 128, "float16", route=key_b) as one:
            one.append(kv[:1], kv[:1])
            t0 = time.perf_counter()
            o = one.attend(q)
            t_attend = time.perf_counter() - t0
        check(o.shape == q.shape and bool(np.all(o == 1)), "the 96 MiB answer is not all ones")
        print(f"one 192 MiB AppendKV message through the proxy: "
              f"{2 * kv.nbytes / t_append['the proxy'] / 1e6:.0f} MB/s (the same to the server "
              f"directly: {2 * kv.nbytes / t_append['directly'] / 1e6:.0f} MB/s); an Attend of "
              f"96 MiB each way through the proxy: {2 * q.nbytes / t_attend / 1e6:.0f} MB/s")

        # A restarted server has lost its sessions; the other's still answer.
        servers[0].stop()
        servers[0] = Server(binary, *flags, f"--listen=127.0.0.1:{ports[0]}")
        lost = not_found(s_a.info)
        print(f"server A restarted on its port: its session {key_a}: {lost[0]} {lost[1]!r}")
        check(lost[0] == "NOT_FOUND", f"after A's restart: {lost}")
        s_b = sessions[key_b][0]
        check(s_b.info().tokens == history[key_b], f"B's session {key_b} lost with A's restart")
        again = c.session(kv_heads, head_dim, dtype, route=key_a)
        check(where(again.id) == [0], f"{key_a} created anew landed on {where(again.id)}, not A")
        again.close()
        for s, _ in sessions.values():
            s.close()
        check(all(not direct(i).sessions() for i in (0, 1)), "sessions left after close()")
    finally:
        proxy.stop()
        codes = [s.stop() for s in servers]
    check(codes == [0, 0], f"the servers' exit codes after SIGTERM: {codes}")
    if not check.failures:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}")
    print(f"{check.passed} passed, {len(check.failures)} failed")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
