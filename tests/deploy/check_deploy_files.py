#!/usr/bin/python3
"""Checks the deployment files in deploy/ against each other and against the server.

Run by ctest (tests/deploy/CMakeLists.txt) with Debian's /usr/bin/python3 and python3-yaml;
exits 77 (skipped) when the yaml module is missing. Usage: check_deploy_files.py REPO_ROOT

What it checks, beyond "every YAML/JSON document parses":
  * Kubernetes manifests: apiVersion/kind/metadata.name, the fields each kind requires, selectors
    that match the pod labels, probes on a declared container port, a GPU limit, a grace period
    longer than the preStop pause plus the server's --drain_timeout, Services whose targetPort
    names a container port, a headless gRPC Service that is the StatefulSet's serviceName, an
    HPA on the StatefulSet and a metric the adapter rule defines;
  * the session router (router.yaml): its nginx.conf is deploy/nginx/nginx.conf, its template is
    deploy/nginx/attnserve-sessions.conf but for the upstream's members (one per StatefulSet pod
    name up to the HPA's maxReplicas, re-resolved) and the listen syntax, an nginx image new
    enough to re-resolve, the placeholders its start script fills in, a non-root read-only pod;
  * deploy/nginx and deploy/haproxy hash on the header the Python client sends (its
    ROUTE_HEADER); with nginx or haproxy on PATH, `nginx -t` and `haproxy -c` accept them;
  * compose.yaml: the GPU reservation, published ports that match the server's flags, the
    Prometheus and Grafana mounts, a stop grace period longer than the drain;
  * prometheus.yml targets the metrics port the server listens on;
  * Grafana: provisioned datasource uid, dashboard panels each with a PromQL expression, and
    every attnserve_* metric they use is one the server defines (server/metrics.cc once it names
    them; the planned list until then);
  * Dockerfile: ports in EXPOSE/CMD/ENV agree, non-root USER, HEALTHCHECK uses the client;
  * every server flag the files pass exists in server/main.cc (an --undefok is reported: it
    would hide a renamed flag);
  * with promtool on PATH (Debian's prometheus package): prometheus.yml passes `promtool check
    config`, and every PromQL expression (dashboard panels, the adapter rule, Grafana and adapter
    template variables filled in) parses, through `promtool check rules`;
  * with docker-compose on PATH: `docker-compose config -q` accepts compose.yaml.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    print("SKIP: python3-yaml is not installed (deploy/install-deps.sh installs it)")
    sys.exit(77)

# The names the metrics work planned (issue 5). Used only while server/metrics.cc names none.
PLANNED_METRICS = {
    "attnserve_requests_total", "attnserve_request_duration_seconds",
    "attnserve_queue_wait_seconds", "attnserve_compute_seconds", "attnserve_batch_requests",
    "attnserve_batch_tokens", "attnserve_tokens_total", "attnserve_flops_total",
    "attnserve_queue_depth", "attnserve_inflight_requests", "attnserve_device_memory_bytes",
    "attnserve_path_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

errors = []
warnings = []
checks = 0


def check(condition, message):
    global checks
    checks += 1
    if not condition:
        errors.append(message)
    return condition


def load_yaml_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def dig(obj, *keys):
    for k in keys:
        if isinstance(obj, dict):
            obj = obj.get(k)
        elif isinstance(obj, list) and isinstance(k, int) and k < len(obj):
            obj = obj[k]
        else:
            return None
    return obj


def parse_duration_s(text):
    """absl/Go-style duration ("30s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def flag_values(args):
    """--name=value arguments as a dict (the form every file here uses)."""
    out = {}
    for a in args:
        m = re.fullmatch(r"--([a-z_]+)(?:=(.*))?", str(a))
        if m:
            out[m.group(1)] = m.group(2) if m.group(2) is not None else "true"
    return out


def port_of(address):
    return int(address.rsplit(":", 1)[1])


class Repo:
    def __init__(self, root):
        self.root = root
        main_cc = self.read("server/main.cc")
        self.flags = set(re.findall(r"ABSL_FLAG\([^,]+,\s*([a-z_0-9]+)", main_cc))
        names = set()
        for rel in ("server/metrics.cc", "server/metrics.h"):
            if os.path.exists(self.path(rel)):
                names |= set(re.findall(r'"(attnserve_[a-z0-9_]+)"', self.read(rel)))
        self.metrics_final = bool(names)
        self.metrics = names or PLANNED_METRICS
        # Default drain timeout of the server, if main.cc states it in seconds.
        m = re.search(r"drain_timeout,\s*absl::Seconds\((\d+)\)", main_cc)
        self.default_drain_s = int(m.group(1)) if m else 30

    def path(self, rel):
        return os.path.join(self.root, rel)

    def read(self, rel):
        with open(self.path(rel)) as f:
            return f.read()


def check_server_args(repo, args, where):
    """Every flag exists in main.cc; returns the flag dict."""
    flags = flag_values(args)
    check("undefok" not in flags,
          f"{where}: --undefok would let a renamed or removed server flag pass unnoticed")
    for name in flags:
        check(name in repo.flags, f"{where}: --{name} is not a server flag (server/main.cc)")
    check("listen" in flags, f"{where}: no --listen")
    if "drain_timeout" in flags:
        parse_duration_s(flags["drain_timeout"])
    return flags


def drain_s(repo, flags):
    if "drain_timeout" in flags:
        return parse_duration_s(flags["drain_timeout"])
    return repo.default_drain_s


def check_metric(repo, name, where):
    """A metric a file uses must be one the server defines. Strict once server/metrics.cc names
    its metrics; before that, names outside the planned list are reported, not failed."""
    base = base_metric(name, repo.metrics)
    if repo.metrics_final:
        check(base, f"{where}: {name} is not a metric server/metrics.cc defines")
    elif not base:
        warnings.append(f"{where}: {name} is not in the planned list (no names in server/metrics.cc)")
    return base or name


promql = []  # (where, expression) pairs, for the promtool check


def metric_names_in(expr):
    return set(re.findall(r"\b(attnserve_[a-z0-9_]+)", expr))


def base_metric(name, known):
    if name in known:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)]
    return None


# ---------------------------------------------------------------- Kubernetes

REQUIRED_SPEC = {
    "Deployment": [("spec", "selector"), ("spec", "template", "spec", "containers")],
    "StatefulSet": [("spec", "selector"), ("spec", "serviceName"),
                    ("spec", "template", "spec", "containers")],
    "Service": [("spec", "ports")],
    "PodDisruptionBudget": [("spec", "selector")],
    "HorizontalPodAutoscaler": [("spec", "scaleTargetRef"), ("spec", "maxReplicas"),
                                ("spec", "metrics")],
    "ConfigMap": [("data",)],
    "Kustomization": [("resources",)],
}
API_VERSIONS = {
    "Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1", "ConfigMap": "v1",
    "PodDisruptionBudget": "policy/v1", "HorizontalPodAutoscaler": "autoscaling/v2",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}


def check_probe(probe, ports, where):
    if not check(isinstance(probe, dict), f"{where}: missing"):
        return
    kinds = [k for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in probe]
    check(kinds == ["grpc"], f"{where}: should be one native grpc probe, has {kinds}")
    port = dig(probe, "grpc", "port")
    check(isinstance(port, int), f"{where}: grpc.port must be a number (Kubernetes rule)")
    check(port in ports.values(), f"{where}: port {port} is not a container port {ports}")
    service = dig(probe, "grpc", "service")
    check(service in (None, "", "attnserve.v1.AttentionService"),
          f"{where}: health service {service!r} is not one the server registers")


def check_k8s(repo):
    k8s_dir = repo.path("deploy/k8s")
    docs = {}
    for name in sorted(os.listdir(k8s_dir)):
        if not name.endswith((".yaml", ".yml")):
            continue
        for i, doc in enumerate(load_yaml_all(os.path.join(k8s_dir, name))):
            where = f"deploy/k8s/{name}[{i}]"
            kind = doc.get("kind")
            check(isinstance(doc.get("apiVersion"), str) and isinstance(kind, str),
                  f"{where}: apiVersion and kind are required")
            if kind in API_VERSIONS:
                check(doc["apiVersion"] == API_VERSIONS[kind],
                      f"{where}: {kind} should be {API_VERSIONS[kind]}, is {doc['apiVersion']}")
            else:
                check(False, f"{where}: kind {kind} is not one this check knows")
            if kind != "Kustomization":
                check(isinstance(dig(doc, "metadata", "name"), str), f"{where}: metadata.name")
            for path in REQUIRED_SPEC.get(kind, []):
                check(dig(doc, *path) is not None, f"{where}: {'.'.join(path)} is required")
            docs.setdefault(kind, []).append((where, name, doc))

    # Kustomization: every resource exists; the adapter example is not applied with the app.
    for where, _, kust in docs.get("Kustomization", []):
        for res in kust.get("resources", []):
            check(os.path.exists(os.path.join(k8s_dir, res)), f"{where}: {res} does not exist")

    # The servers: one StatefulSet (sessions make each pod stateful, and the router's ring is
    # made of the pods' stable names).
    check(len(docs.get("StatefulSet", [])) == 1, "deploy/k8s: expected one StatefulSet")
    if not docs.get("StatefulSet"):
        return
    where, _, dep = docs["StatefulSet"][0]
    pod_labels = dig(dep, "spec", "template", "metadata", "labels") or {}
    match = dig(dep, "spec", "selector", "matchLabels") or {}
    check(match and all(pod_labels.get(k) == v for k, v in match.items()),
          f"{where}: selector.matchLabels {match} must match the pod labels {pod_labels}")
    pod = dig(dep, "spec", "template", "spec")
    containers = pod["containers"]
    check(len(containers) == 1, f"{where}: one container expected")
    c = containers[0]
    for field in ("name", "image"):
        check(c.get(field), f"{where}: containers[0].{field} is required")
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    check({"grpc", "metrics"} <= set(ports), f"{where}: ports named grpc and metrics expected")
    flags = check_server_args(repo, c.get("args", []), f"{where} args")
    if "listen" in flags:
        check(port_of(flags["listen"]) == ports.get("grpc"),
              f"{where}: --listen port differs from the grpc containerPort")
        check(flags["listen"].startswith("0.0.0.0:"),
              f"{where}: --listen must bind all interfaces in a pod")
    if "metrics_address" in flags:
        check(port_of(flags["metrics_address"]) == ports.get("metrics"),
              f"{where}: --metrics_address port differs from the metrics containerPort")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        check_probe(c.get(probe), ports, f"{where}: {probe}")
    limits = dig(c, "resources", "limits") or {}
    requests = dig(c, "resources", "requests") or {}
    check(int(limits.get("nvidia.com/gpu", 0)) == 1, f"{where}: limits nvidia.com/gpu: 1")
    check(requests.get("nvidia.com/gpu") in (None, limits.get("nvidia.com/gpu")),
          f"{where}: GPU request must equal the limit")
    check("cpu" in requests and "memory" in requests, f"{where}: cpu and memory requests")
    pre_stop = dig(c, "lifecycle", "preStop", "exec", "command") or []
    pre_stop_s = float(pre_stop[1]) if len(pre_stop) == 2 and pre_stop[0] == "sleep" else 0
    grace = pod.get("terminationGracePeriodSeconds", 30)
    drain = drain_s(repo, flags)
    check(grace > pre_stop_s + drain,
          f"{where}: terminationGracePeriodSeconds {grace} must exceed preStop {pre_stop_s}s + "
          f"--drain_timeout {drain}s")
    live = c.get("livenessProbe") or {}
    check(live.get("periodSeconds", 10) * live.get("failureThreshold", 3) > drain,
          f"{where}: livenessProbe period x failureThreshold must outlast --drain_timeout "
          f"{drain}s (health is NOT_SERVING while draining)")
    check(dig(pod, "securityContext", "runAsNonRoot") is True, f"{where}: runAsNonRoot")
    ann = dig(dep, "spec", "template", "metadata", "annotations") or {}
    if "prometheus.io/port" in ann:
        check(int(ann["prometheus.io/port"]) == ports.get("metrics"),
              f"{where}: prometheus.io/port differs from the metrics port")

    routers = [d for d in docs.get("Deployment", [])
               if dig(d[2], "metadata", "name") == "attnserve-router"]
    check(len(docs.get("Deployment", [])) == len(routers) == 1,
          "deploy/k8s: expected one Deployment, attnserve-router (router.yaml)")
    router_labels, router_ports = {}, {}
    if routers:
        router_labels = dig(routers[0][2], "spec", "template", "metadata", "labels") or {}
        router_ports = {p.get("name"): p.get("containerPort") for p in
                        dig(routers[0][2], "spec", "template", "spec", "containers", 0, "ports")
                        or []}

    headless = 0
    for swhere, _, svc in docs.get("Service", []):
        sel = dig(svc, "spec", "selector") or {}
        selects = lambda labels: bool(sel) and all(labels.get(k) == v for k, v in sel.items())
        check(selects(pod_labels) != selects(router_labels),
              f"{swhere}: selector {sel} selects neither the servers' nor the router's pods")
        targets = ports if selects(pod_labels) else router_ports
        for p in dig(svc, "spec", "ports") or []:
            target = p.get("targetPort", p.get("port"))
            check(target in targets or target in targets.values(),
                  f"{swhere}: targetPort {target} is not a container port")
        if dig(svc, "spec", "clusterIP") == "None":
            headless += 1
            grpc = [p for p in svc["spec"]["ports"] if p.get("targetPort") == "grpc"]
            check(grpc and grpc[0].get("appProtocol") == "grpc",
                  f"{swhere}: the headless Service should carry the grpc port (appProtocol grpc)")
            check(selects(pod_labels) and svc["metadata"]["name"] == dep["spec"]["serviceName"],
                  f"{swhere}: the headless Service must be the StatefulSet's serviceName "
                  f"({dep['spec']['serviceName']}): it names the pods the router resolves")
            check(dig(svc, "spec", "publishNotReadyAddresses") is not True,
                  f"{swhere}: pods that are not ready must leave DNS (and so the router's ring)")
        ann = dig(svc, "metadata", "annotations") or {}
        if "prometheus.io/port" in ann:
            check(int(ann["prometheus.io/port"]) == ports.get("metrics"),
                  f"{swhere}: prometheus.io/port differs from the metrics port")
    check(headless == 1, "deploy/k8s: one headless Service (clusterIP: None) for gRPC clients")

    for pwhere, _, pdb in docs.get("PodDisruptionBudget", []):
        sel = dig(pdb, "spec", "selector", "matchLabels") or {}
        check(sel and all(pod_labels.get(k) == v for k, v in sel.items()),
              f"{pwhere}: selector does not select the StatefulSet's pods")

    adapter_names = set()
    for cwhere, _, cm in docs.get("ConfigMap", []):
        cfg = yaml.safe_load(dig(cm, "data", "config.yaml") or "") or {}
        for rule in cfg.get("rules", []):
            for field in ("seriesQuery", "metricsQuery", "name", "resources"):
                check(field in rule, f"{cwhere}: adapter rule without {field}")
            adapter_names.add(dig(rule, "name", "as"))
            for expr in (rule.get("seriesQuery", ""), rule.get("metricsQuery", "")):
                for m in metric_names_in(expr):
                    check_metric(repo, m, cwhere)
            check("<<.LabelMatchers>>" in rule.get("metricsQuery", ""),
                  f"{cwhere}: metricsQuery must use <<.LabelMatchers>>")
            promql.append((f"{cwhere}: metricsQuery", rule.get("metricsQuery", "")))
    for hwhere, _, hpa in docs.get("HorizontalPodAutoscaler", []):
        ref = hpa["spec"]["scaleTargetRef"]
        check(ref.get("kind") == "StatefulSet" and ref.get("name") == dep["metadata"]["name"],
              f"{hwhere}: scaleTargetRef does not name the StatefulSet")
        check(hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"],
              f"{hwhere}: minReplicas > maxReplicas")
        for m in hpa["spec"]["metrics"]:
            if m.get("type") in ("Pods", "External"):
                key = m["type"].lower()
                name = dig(m, key, "metric", "name")
                check(name in adapter_names,
                      f"{hwhere}: metric {name} is not defined by an adapter rule "
                      f"({sorted(adapter_names)})")
                target = dig(m, key, "target") or {}
                check(target.get("type") in ("AverageValue", "Value"),
                      f"{hwhere}: {m['type']} metric target needs AverageValue or Value")

    if routers:
        hpas = docs.get("HorizontalPodAutoscaler", [])
        max_replicas = hpas[0][2]["spec"]["maxReplicas"] if hpas else dep["spec"]["replicas"]
        check_router(repo, docs, routers[0], dep, ports, max_replicas)


# ---------------------------------------------------------------- KV session routing

def route_header(repo):
    """The header the Python client sends a session's route key in."""
    m = re.search(r'^ROUTE_HEADER = "([a-z0-9-]+)"', repo.read("clients/python/attnserve/session.py"),
                  re.M)
    return m.group(1) if m else "x-attnserve-route"


def nginx_statements(text):
    """The directives of an nginx file, comments and layout dropped, one per item (a block's
    opening and closing brace are items too; ${NAME} placeholders stay whole)."""
    text = re.sub(r"#[^\n]*", "", re.sub(r"\$\{([A-Z_]+)\}", r"@\1@", text))
    return [re.sub(r"@([A-Z_]+)@", r"${\1}", " ".join(t.split()))
            for t in re.split(r"(?<=[;{}])", text) if t.strip()]


def check_router(repo, docs, router, servers, server_ports, max_replicas):
    """router.yaml: nginx hashing on the route header over the StatefulSet's pod names."""
    where, _, dep = router
    maps = [d for d in docs.get("ConfigMap", []) if dig(d[2], "metadata", "name") == "attnserve-router"]
    if not check(len(maps) == 1, "deploy/k8s: the router's ConfigMap attnserve-router"):
        return
    cwhere, _, cm = maps[0]
    data = cm.get("data") or {}
    check(data.get("nginx.conf") == repo.read("deploy/nginx/nginx.conf"),
          f"{cwhere}: nginx.conf must be deploy/nginx/nginx.conf as is")
    template = data.get("attnserve-sessions.conf.template", "")
    host = nginx_statements(repo.read("deploy/nginx/attnserve-sessions.conf"))
    cluster = nginx_statements(template)
    # Where the two may differ: the upstream's members (with the ring's zone and resolver) and
    # nginx >= 1.25.1's spelling of an HTTP/2 listener.
    member = re.compile(r"(server|zone|resolver) .*;$")
    same_host = [t for t in host if not member.match(t)]
    same_cluster = ["listen 50051 http2;" if t == "listen 50051;" else t for t in cluster
                    if not member.match(t) and t != "http2 on;"]
    check(same_host == same_cluster,
          f"{cwhere}: attnserve-sessions.conf.template differs from "
          f"deploy/nginx/attnserve-sessions.conf beyond the upstream's members and the listen "
          f"syntax: {sorted(set(same_host) ^ set(same_cluster))}")
    name, service = servers["metadata"]["name"], servers["spec"]["serviceName"]
    want = [f"server {name}-{i}.{service}.${{POD_NAMESPACE}}.svc.cluster.local:"
            f"{server_ports.get('grpc')} resolve;" for i in range(max_replicas)]
    got = [t for t in cluster if member.match(t) and t.startswith("server ")]
    check(got == want, f"{cwhere}: the ring must list the StatefulSet's pods {name}-0 to "
                       f"{name}-{max_replicas - 1} (the HPA's maxReplicas), re-resolved: {got}")
    check(any(t.startswith("zone ") for t in cluster) and
          "resolver ${RESOLVER} valid=5s ipv6=off;" in cluster,
          f"{cwhere}: re-resolved servers need a zone and the resolver placeholder")

    pod = dig(dep, "spec", "template", "spec") or {}
    containers = pod.get("containers") or [{}]
    c = containers[0]
    check(len(containers) == 1, f"{where}: one container expected")
    image = str(c.get("image", ""))
    m = re.fullmatch(r"nginx:(\d+)\.(\d+)(?:\.(\d+))?(-\S+)?", image)
    version = tuple(int(x or 0) for x in m.groups()[:3]) if m else (0, 0, 0)
    check(version >= (1, 27, 3), f"{where}: image {image!r}: the re-resolved upstream needs "
                                 "the nginx image >= 1.27.3")
    script = " ".join(c.get("command", []) + c.get("args", []))
    placeholders = set(re.findall(r"\$\{([A-Z_]+)\}", template))
    filled = set(re.findall(r"s/\\\$\{([A-Z_]+)\}/", script))
    check(placeholders and placeholders == filled,
          f"{where}: the start script fills {sorted(filled)}, the template uses "
          f"{sorted(placeholders)}")
    env = {e.get("name"): e for e in c.get("env", [])}
    check(dig(env.get("POD_NAMESPACE"), "valueFrom", "fieldRef", "fieldPath") ==
          "metadata.namespace", f"{where}: POD_NAMESPACE from the downward API")
    mounts = {v.get("mountPath"): v.get("name") for v in c.get("volumeMounts", [])}
    volumes = {v.get("name"): v for v in pod.get("volumes", [])}
    for path in set(re.findall(r"(/(?:etc|tmp)/[a-z-]+)/", script)):
        check(path in mounts, f"{where}: the start script uses {path}, which is not mounted")
    config = [n for n, v in volumes.items() if dig(v, "configMap", "name") == "attnserve-router"]
    check(config and config[0] in mounts.values(), f"{where}: the ConfigMap is not mounted")
    m = re.search(r"nginx -p (\S+?)/? ", script)
    prefix = m.group(1) if m else None
    check(prefix in mounts and "emptyDir" in volumes.get(mounts.get(prefix), {}),
          f"{where}: nginx's -p prefix {prefix} must be an emptyDir (pid, temporary files)")
    check(dig(pod, "securityContext", "runAsNonRoot") is True and
          dig(c, "securityContext", "readOnlyRootFilesystem") is True,
          f"{where}: runAsNonRoot and a read-only root filesystem")
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    check("listen 50051;" in cluster and ports.get("grpc") == 50051,
          f"{where}: the container's grpc port is the template's listen port")
    for probe in ("readinessProbe", "livenessProbe"):
        check(dig(c, probe, "tcpSocket", "port") in ("grpc", 50051),
              f"{where}: {probe} on the grpc port")


def check_proxy_configs(repo):
    """deploy/nginx and deploy/haproxy hash on the client's route header; nginx -t and
    haproxy -c accept them when the binaries are installed."""
    header = route_header(repo)
    nginx = nginx_statements(repo.read("deploy/nginx/attnserve-sessions.conf"))
    variable = "$http_" + header.replace("-", "_")
    check(f"hash {variable} consistent;" in nginx,
          f"deploy/nginx: the upstream must hash `{variable} consistent` (the client's {header})")
    check("client_max_body_size 0;" in nginx,
          "deploy/nginx: client_max_body_size 0 (a stream's body is all of its messages)")
    check("grpc_pass grpc://attnserve;" in nginx, "deploy/nginx: grpc_pass to the upstream")
    haproxy = repo.read("deploy/haproxy/attnserve-sessions.cfg")
    check(re.search(rf"^\s*balance hdr\({header}\)\s*$", haproxy, re.M) and
          re.search(r"^\s*hash-type consistent\s*$", haproxy, re.M),
          f"deploy/haproxy: `balance hdr({header})` with `hash-type consistent`")
    tool = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK)
                                     else None)
    if tool:
        with tempfile.TemporaryDirectory() as prefix:
            run = subprocess.run([tool, "-t", "-q", "-p", prefix + "/", "-c",
                                  os.path.abspath(repo.path("deploy/nginx/nginx.conf")), "-e",
                                  "stderr"],
                                 capture_output=True, text=True, timeout=60)
        check(run.returncode == 0, f"nginx -t deploy/nginx/nginx.conf: {run.stderr}")
    else:
        print("note: no nginx on PATH; deploy/nginx not checked by nginx -t")
    tool = shutil.which("haproxy") or ("/usr/sbin/haproxy"
                                       if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if tool:
        run = subprocess.run([tool, "-c", "-q", "-f",
                              repo.path("deploy/haproxy/attnserve-sessions.cfg")],
                             capture_output=True, text=True, timeout=60)
        check(run.returncode == 0, f"haproxy -c deploy/haproxy: {run.stdout}{run.stderr}")
    else:
        print("note: no haproxy on PATH; deploy/haproxy not checked by haproxy -c")


# ---------------------------------------------------------------- compose, Prometheus, Grafana

def check_compose_and_monitoring(repo):
    compose = load_yaml_all(repo.path("deploy/compose.yaml"))
    check(len(compose) == 1, "compose.yaml: one document")
    services = compose[0].get("services", {})
    check({"attnserve", "prometheus", "grafana"} <= set(services),
          f"compose.yaml: services attnserve, prometheus, grafana expected, has {sorted(services)}")
    srv = services.get("attnserve", {})
    devices = dig(srv, "deploy", "resources", "reservations", "devices") or []
    check(any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
              for d in devices), "compose.yaml: attnserve needs an nvidia GPU reservation")
    check(dig(srv, "build", "dockerfile") == "deploy/Dockerfile" and
          os.path.exists(repo.path(os.path.join("deploy", dig(srv, "build", "context") or "",
                                                "deploy/Dockerfile"))),
          "compose.yaml: build context/dockerfile must reach deploy/Dockerfile")
    flags = check_server_args(repo, srv.get("command", []), "compose.yaml attnserve.command")
    published = {}
    for p in srv.get("ports", []):
        parts = str(p).split(":")
        published[int(parts[-1])] = int(parts[-2])
    if "listen" in flags:
        check(port_of(flags["listen"]) in published, "compose.yaml: the gRPC port is not published")
    metrics_port = port_of(flags["metrics_address"]) if "metrics_address" in flags else None
    check(metrics_port is not None and metrics_port in published,
          "compose.yaml: the metrics port is not published")
    grace = parse_duration_s(srv.get("stop_grace_period", "10s"))
    check(grace > drain_s(repo, flags),
          f"compose.yaml: stop_grace_period {grace}s must exceed the drain timeout")
    vols = " ".join(services.get("prometheus", {}).get("volumes", []))
    check("./prometheus.yml:/etc/prometheus/prometheus.yml" in vols,
          "compose.yaml: prometheus must mount ./prometheus.yml")
    vols = " ".join(services.get("grafana", {}).get("volumes", []))
    check("./grafana/provisioning:/etc/grafana/provisioning" in vols and
          "./grafana/dashboards:" in vols, "compose.yaml: grafana must mount provisioning and dashboards")

    prom = load_yaml_all(repo.path("deploy/prometheus.yml"))[0]
    jobs = {j.get("job_name"): j for j in prom.get("scrape_configs", [])}
    check("attnserve" in jobs, "prometheus.yml: a job named attnserve")
    targets = [t for sc in jobs.get("attnserve", {}).get("static_configs", [])
               for t in sc.get("targets", [])]
    check(f"attnserve:{metrics_port}" in targets,
          f"prometheus.yml: target attnserve:{metrics_port} (the compose service's metrics "
          f"address) expected, has {targets}")
    # tests/prometheus rewrites the file's one inline target ("targets: [\"...\"]") to its
    # loopback server, and falls back to a built-in config when it finds more or fewer.
    inline = re.findall(r'targets:\s*\[\s*"([^"]+)"', repo.read("deploy/prometheus.yml"))
    check(len(inline) == 1, f"prometheus.yml: exactly one inline target for tests/prometheus to "
                            f"rewrite, found {inline}")
    check(jobs.get("attnserve", {}).get("metrics_path", "/metrics") == "/metrics",
          "prometheus.yml: metrics_path /metrics")

    ds = load_yaml_all(repo.path("deploy/grafana/provisioning/datasources/prometheus.yaml"))[0]
    uids = {d.get("uid") for d in ds.get("datasources", []) if d.get("type") == "prometheus"}
    check(len(uids) == 1, "grafana datasources: one Prometheus datasource with a uid")
    urls = {d.get("url") for d in ds.get("datasources", [])}
    check("http://prometheus:9090" in urls, "grafana datasource must point at the prometheus service")
    prov = load_yaml_all(repo.path("deploy/grafana/provisioning/dashboards/attnserve.yaml"))[0]
    paths = [dig(p, "options", "path") for p in prov.get("providers", [])]
    check("/var/lib/grafana/dashboards" in paths,
          "grafana dashboard provider must read /var/lib/grafana/dashboards")

    dash_dir = repo.path("deploy/grafana/dashboards")
    used = set()
    for name in sorted(os.listdir(dash_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(dash_dir, name)) as f:
            dash = json.load(f)
        where = f"deploy/grafana/dashboards/{name}"
        check(dash.get("uid") and dash.get("title"), f"{where}: uid and title")
        var_ds = [v for v in dig(dash, "templating", "list") or [] if v.get("type") == "datasource"]
        check(not var_ds or dig(var_ds[0], "current", "value") in uids,
              f"{where}: the datasource variable's default is not the provisioned uid")
        ids = [p.get("id") for p in dash.get("panels", [])]
        check(len(ids) == len(set(ids)), f"{where}: panel ids must be unique")
        for p in dash.get("panels", []):
            if p.get("type") == "row":
                continue
            targets = p.get("targets", [])
            check(targets, f"{where}: panel {p.get('title')!r} has no query")
            for t in targets:
                expr = t.get("expr", "")
                check(expr, f"{where}: panel {p.get('title')!r} has an empty expr")
                promql.append((f"{where}: panel {p.get('title')!r}", expr))
                check(expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"),
                      f"{where}: unbalanced brackets in {expr!r}")
                for m in metric_names_in(expr):
                    used.add(check_metric(repo, m, f"{where}: panel {p.get('title')!r}"))
    for wanted in ("attnserve_tokens_total", "attnserve_flops_total", "attnserve_requests_total",
                   "attnserve_request_duration_seconds", "attnserve_queue_wait_seconds",
                   "attnserve_requests_queued", "attnserve_batch_requests",
                   "attnserve_batch_tokens", "attnserve_device_memory_used_bytes",
                   "attnserve_path_total"):
        if wanted in repo.metrics:
            check(wanted in used, f"grafana: no panel shows {wanted}")


# ---------------------------------------------------------------- Dockerfile

def check_dockerfile(repo):
    text = repo.read("deploy/Dockerfile").replace("\\\n", " ")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", "\n".join(lines), re.M))
    for a in ("BUILD_BASE", "RUNTIME_BASE", "ATTN_CUDA", "GRPC_PORT", "METRICS_PORT"):
        check(a in args, f"Dockerfile: ARG {a} with a default")
    check(len([l for l in lines if l.startswith("FROM ")]) >= 2, "Dockerfile: multi-stage")
    check(any("install-deps.sh" in l and l.startswith("RUN") for l in lines),
          "Dockerfile: dependencies through deploy/install-deps.sh")
    users = [l.split()[1] for l in lines if l.startswith("USER ")]
    check(users and not users[-1].startswith(("0", "root")), "Dockerfile: a non-root USER last")
    hc = [l for l in lines if l.startswith("HEALTHCHECK")]
    check(hc and "attnserve_client health" in hc[0], "Dockerfile: HEALTHCHECK via the client")
    cmd = [l for l in lines if l.startswith("CMD ")]
    if check(len(cmd) == 1, "Dockerfile: one CMD"):
        flags = check_server_args(repo, json.loads(cmd[0][4:]), "Dockerfile CMD")
        check(str(port_of(flags.get("listen", ":0"))) == args.get("GRPC_PORT"),
              "Dockerfile: CMD --listen port differs from ARG GRPC_PORT")
        if "metrics_address" in flags:
            check(str(port_of(flags["metrics_address"])) == args.get("METRICS_PORT"),
                  "Dockerfile: CMD --metrics_address port differs from ARG METRICS_PORT")
    expose = [l for l in lines if l.startswith("EXPOSE ")]
    check(expose and "${GRPC_PORT}" in expose[0] and "${METRICS_PORT}" in expose[0],
          "Dockerfile: EXPOSE the gRPC and metrics ports")
    ignore = repo.read(".dockerignore")
    check("build*/" in ignore and ".git" in ignore, ".dockerignore: build folders and .git")


def fill_templates(expr):
    """Grafana's and prometheus-adapter's template variables, replaced by plain PromQL."""
    expr = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
    expr = expr.replace("<<.LabelMatchers>>", 'namespace="ns",pod="p"')
    return expr.replace("<<.GroupBy>>", "namespace, pod")


def check_with_promtool(repo):
    promtool = shutil.which("promtool")
    if not promtool:
        print("note: no promtool on PATH; PromQL and prometheus.yml not checked by Prometheus")
        return
    run = subprocess.run([promtool, "check", "config", repo.path("deploy/prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    check(run.returncode == 0, f"promtool check config deploy/prometheus.yml: {run.stdout}"
                               f"{run.stderr}")
    rules = [{"record": f"attnserve:check_{i}", "expr": fill_templates(expr)}
             for i, (_, expr) in enumerate(promql)]
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        yaml.safe_dump({"groups": [{"name": "deploy_files", "rules": rules}]}, f)
        f.flush()
        run = subprocess.run([promtool, "check", "rules", f.name], capture_output=True,
                             text=True, timeout=60)
    ok = check(run.returncode == 0 and f"{len(rules)} rules found" in run.stdout,
               f"promtool check rules: {run.stdout}{run.stderr}")
    if not ok:  # name the expressions promtool refused
        for i, (where, expr) in enumerate(promql):
            if f"check_{i}" in run.stdout + run.stderr:
                errors.append(f"{where}: {expr}")
    print(f"promtool: prometheus.yml valid; {len(rules)} PromQL expressions parse"
          if ok else "promtool: FAILED")


def check_with_compose(repo):
    """docker-compose (Debian's 1.29, which validates against the Compose schema without an
    engine), when installed: `config -q` must accept compose.yaml."""
    tool = shutil.which("docker-compose")
    if not tool:
        print("note: no docker-compose on PATH; compose.yaml not checked against the schema")
        return
    run = subprocess.run([tool, "-f", repo.path("deploy/compose.yaml"), "config", "-q"],
                         capture_output=True, text=True, timeout=120)
    if check(run.returncode == 0, f"docker-compose config: {run.stdout}{run.stderr}"):
        print("docker-compose: compose.yaml valid")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    repo = Repo(sys.argv[1])
    for fn in (check_k8s, check_proxy_configs, check_compose_and_monitoring, check_dockerfile,
               check_with_promtool,
               check_with_compose):
        try:
            fn(repo)
        except Exception as e:  # a parse error or a missing file is a failure, with its cause
            errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")
    print(f"metric names: {'server/metrics.cc' if repo.metrics_final else 'planned list'} "
          f"({len(repo.metrics)} names)")
    for w in warnings:
        print("warning:", w)
    for e in errors:
        print("FAIL:", e)
    print(f"{checks} checks, {len(errors)} failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
