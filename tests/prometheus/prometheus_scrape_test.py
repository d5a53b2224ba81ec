#!/usr/bin/python3
"""attnserve scraped by a real Prometheus server, queried through Prometheus's HTTP API.

Starts attnserve (CPU engine) with its gRPC and metrics ports on ephemeral loopback ports,
then Debian's `prometheus` on a free loopback port with its own temporary data directory and
a configuration derived from deploy/prometheus.yml (the target replaced by the loopback server,
scrape_interval 1s), drives load with attnserve_client, and asserts through /api/v1/query:
the target is up, rate(attnserve_requests_total[...]) > 0, tokens/s and FLOP/s > 0, and the
p99 of attnserve_request_duration_seconds is finite, positive and sane. Everything it starts
is stopped; the whole run is bounded (DEADLINE_S). Exits 77 (skipped) when prometheus is not
installed.

Usage: prometheus_scrape_test.py ATTNSERVE ATTNSERVE_CLIENT DEPLOY_PROMETHEUS_YML
"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

DEADLINE_S = 55
RANGE = "15s"  # rate() windows: at a 1 s scrape interval, plenty of samples

FALLBACK_CONFIG = """global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: attnserve
    metrics_path: /metrics
    static_configs:
      - targets: ["TARGET"]
"""


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_file(path, process, deadline):
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before writing {path}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {path}")


def prometheus_config(deploy_yml, target):
    """deploy/prometheus.yml with the loopback target and 1 s intervals, or a minimal config."""
    if os.path.exists(deploy_yml):
        with open(deploy_yml) as f:
            text = f.read()
        targets = re.findall(r'targets:\s*\[\s*"([^"]+)"', text)
        if len(targets) == 1:
            text = text.replace(targets[0], target)
            text = re.sub(r"(scrape_interval|evaluation_interval):\s*\S+", r"\1: 1s", text)
            log(f"config: {deploy_yml} with target {target}, intervals 1s")
            return text
        log(f"config: {deploy_yml} has {len(targets)} targets; using the built-in config")
    return FALLBACK_CONFIG.replace("TARGET", target)


def query(base, promql):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{promql}: {body}")
    return [float(sample["value"][1]) for sample in body["data"]["result"]]


def stop(process, name):
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log(f"{name} did not stop on SIGTERM; killing it")
        process.kill()
        process.wait()


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    server_binary, client_binary, deploy_yml = sys.argv[1:]
    prometheus = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
    if prometheus is None:
        print("skipped: prometheus is not installed (Debian: apt-get install prometheus)")
        return 77

    deadline = time.monotonic() + DEADLINE_S
    work = tempfile.mkdtemp(prefix="attn_prometheus_")
    server = prom = load = None
    server_log = open(os.path.join(work, "attnserve.log"), "w")
    prom_log = open(os.path.join(work, "prometheus.log"), "w")
    ok = False
    try:
        server = subprocess.Popen(
            [server_binary, "--listen=127.0.0.1:0", f"--port_file={work}/port",
             "--metrics_address=127.0.0.1:0", f"--metrics_port_file={work}/metrics_port",
             "--cpu_threads=1"],
            stdout=server_log, stderr=subprocess.STDOUT)
        grpc_port = wait_for_file(f"{work}/port", server, deadline)
        metrics_port = wait_for_file(f"{work}/metrics_port", server, deadline)
        log(f"attnserve: gRPC on {grpc_port}, metrics on {metrics_port}")

        config = os.path.join(work, "prometheus.yml")
        with open(config, "w") as f:
            f.write(prometheus_config(deploy_yml, f"127.0.0.1:{metrics_port}"))
        prom_port = free_port()
        base = f"http://127.0.0.1:{prom_port}"
        prom = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work}/data",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=prom_log, stderr=subprocess.STDOUT, cwd=work)
        while True:
            if prom.poll() is not None:
                raise RuntimeError(f"prometheus exited with {prom.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus did not become ready")
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        log(f"prometheus ready on {prom_port}")

        # Closed-loop load for long enough to give rate() several scrapes.
        load = subprocess.Popen(
            [client_binary, "bench", f"--target=127.0.0.1:{grpc_port}", "--duration=20s",
             "--concurrency=2", "--channels=1", "--seqlen_q=64", "--seqlen_k=64", "--heads=4",
             "--head_dim=32", "--causal"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        checks = {
            "target up": ('up{job="attnserve"}', lambda v: v == 1),
            "request rate": (f'sum(rate(attnserve_requests_total{{code="OK"}}[{RANGE}]))',
                             lambda v: v > 0),
            "tokens/s": (f"sum(rate(attnserve_tokens_total[{RANGE}]))", lambda v: v > 0),
            "FLOP/s": (f"sum(rate(attnserve_flops_total[{RANGE}]))", lambda v: v > 0),
            "p99 latency": ("histogram_quantile(0.99, sum by (le) "
                            f"(rate(attnserve_request_duration_seconds_bucket[{RANGE}])))",
                            lambda v: math.isfinite(v) and 0 < v < 60),
            "p99 compute": ("histogram_quantile(0.99, sum by (le) "
                            f"(rate(attnserve_compute_seconds_bucket[{RANGE}])))",
                            lambda v: math.isfinite(v) and 0 < v < 60),
        }
        passed = {}
        while len(passed) < len(checks) and time.monotonic() < deadline:
            for name, (promql, good) in checks.items():
                if name in passed:
                    continue
                values = query(base, promql)
                if len(values) == 1 and good(values[0]):
                    passed[name] = values[0]
                    log(f"ok   {name}: {promql} = {values[0]:.6g}")
            time.sleep(1)
        for name, (promql, _) in checks.items():
            if name not in passed:
                log(f"FAIL {name}: {promql} = {query(base, promql)}")
        ok = len(passed) == len(checks)
    except Exception as e:  # report, then clean up below
        log(f"error: {e}")
    finally:
        stop(load, "attnserve_client")
        stop(prom, "prometheus")
        stop(server, "attnserve")
        server_log.close()
        prom_log.close()
        if not ok:
            for name in ("attnserve.log", "prometheus.log"):
                with open(os.path.join(work, name)) as f:
                    print(f"---- {name} (last lines)\n" + "".join(f.readlines()[-30:]))
        shutil.rmtree(work, ignore_errors=True)
    log("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
