"""deploy/, checked offline: the manifests, the image recipe, the extras and the docs' commands, read
together. Each manifest is validated against a schema of the fields KubeRay v1 and Kubernetes
accept (tests/data/kuberay_v1.schema.json, unknown fields refused), then for what kubectl cannot
see: every `lockstep` command line parses with the real CLI, the run config in the ConfigMap loads,
mounts name volumes that exist, ConfigMaps, claims, Secrets and env references resolve, replica
bounds and resources are consistent, Services select pods that exist; a driver in a sidecar reaches
Ray as Ray supports it; every process that writes a ReadWriteOnce volume runs in the one pod that
mounts it, whose fsGroup is the image's group; the image installs the drivers its URLs need and
the tested Ray, from a build context without .venv, runs/ or .git; docs/deploy.md's commands name
files that exist and expand the pod's variables in the pod. Each check has an edited copy that it
must reject (the last tests)."""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from docker.utils.build import exclude_paths
from packaging.requirements import Requirement

from lockstep.cli import build_parser
from lockstep.config import load
from lockstep.raylocal import is_loopback
from lockstep.service.launch import SLOT

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
SCHEMA = json.loads((Path(__file__).parent / "data" / "kuberay_v1.schema.json").read_text())
BY_KIND = {branch["properties"]["kind"]["const"]: jsonschema.Draft202012Validator(
    {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], **branch}) for branch in SCHEMA["oneOf"]}
"""One validator per kind, so that an error names the field rather than "matches none of the kinds"."""
UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
SINGLE_WRITER = {"ReadWriteOnce", "ReadWriteOncePod"}
RAY_TMP = "/tmp/ray"
"""Where a node's raylet keeps its Unix sockets; a driver in another container needs the same directory."""


@dataclass
class Deploy:
    """What deploy/ is made of, as text or parsed, so that a test can hand the checks an edited copy."""

    docs: list[dict]
    """Every manifest's documents, all files together (a claim in storage.yaml serves the others)."""
    dockerfile: str
    dockerignore: str
    pyproject: dict
    constraints: str
    setup_sh: str
    guide: str
    """docs/deploy.md."""
    files: set[str] = field(default_factory=set)
    """Paths (relative to the repository) that exist, for the files the guide names."""


@functools.cache
def parser():
    """The CLI's parser, built once (it is reusable, and building it is most of a check's time)."""
    return build_parser()


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d is not None]


def _text(path: Path) -> str:
    """A file's text; "" when it is missing (the checks then say what it lacks)."""
    return path.read_text() if path.exists() else ""


@functools.cache
def _current() -> Deploy:
    return Deploy(docs=[d for p in MANIFESTS for d in documents(p)],
                  dockerfile=(ROOT / "deploy" / "Dockerfile").read_text(),
                  dockerignore=_text(ROOT / ".dockerignore"),
                  pyproject=tomllib.loads((ROOT / "pyproject.toml").read_text()),
                  constraints=_text(ROOT / "deploy" / "constraints.txt"),
                  setup_sh=(ROOT / "scripts" / "setup.sh").read_text(),
                  guide=(ROOT / "docs" / "deploy.md").read_text(),
                  files={str(p.relative_to(ROOT)) for p in (ROOT / "deploy").rglob("*")})


def current() -> Deploy:
    """deploy/ as it is (a copy: a test may edit it)."""
    return copy.deepcopy(_current())


def quantity(q: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", q).groups()
    return float(number) * UNITS[unit]


def pods(doc: dict):
    """(where, pod spec, rayStartParams or None, replicas) of every pod template of a document:
    a RayCluster's or RayJob's head and worker groups, a StatefulSet's template."""
    if doc["kind"] == "StatefulSet":
        yield "pods", doc["spec"]["template"]["spec"], None, doc["spec"].get("replicas", 1)
        return
    spec = doc["spec"].get("rayClusterSpec", doc["spec"]) if doc["kind"] in ("RayCluster", "RayJob") else None
    if not spec or "headGroupSpec" not in spec:
        return
    yield "head", spec["headGroupSpec"]["template"]["spec"], spec["headGroupSpec"].get("rayStartParams", {}), 1
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]["spec"], group.get("rayStartParams", {}), group.get("maxReplicas", group.get("replicas", 1))


def problems(d: Deploy) -> list[str]:
    """Everything wrong with deploy/ (empty: it is fine)."""
    out = schema_problems(d.docs)
    if out:
        return out
    return (manifest_problems(d.docs) + storage_problems(d) + ray_version_problems(d) + extras_problems(d)
            + dockerignore_problems(d) + guide_problems(d))


def schema_problems(docs: list[dict]) -> list[str]:
    out = []
    for doc in docs:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind not in BY_KIND:
            out.append(f"{kind}: not a kind deploy/ uses ({sorted(BY_KIND)}); extend the schema")
            continue
        for error in BY_KIND[kind].iter_errors(doc):
            out.append(f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}: schema: "
                       f"{'/'.join(map(str, error.absolute_path))}: {error.message[:200]}")
    return out


def manifest_problems(docs: list[dict]) -> list[str]:
    out = []
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        groups = doc["spec"].get("rayClusterSpec", doc["spec"]).get("workerGroupSpecs", []) if doc["kind"] in ("RayCluster", "RayJob") else []
        if len({g["groupName"] for g in groups}) != len(groups):
            out.append(f"{name}: worker group names repeat")
        for g in groups:
            lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 2**31)
            if not lo <= n <= hi:
                out.append(f"{name}: group {g['groupName']}: replicas {n} outside [{lo}, {hi}]")
        claim_templates = {t["metadata"]["name"]: t for t in doc.get("spec", {}).get("volumeClaimTemplates", [])}
        for where, pod, ray_params, _ in pods(doc):
            volumes = {**claim_templates, **{v["name"]: v for v in pod.get("volumes", [])}}
            for v in volumes.values():
                if "configMap" in v and v["configMap"]["name"] not in configmaps:
                    out.append(f"{name} {where}: volume {v['name']} names ConfigMap {v['configMap']['name']}, not in deploy/")
            for i, c in enumerate(pod["containers"]):
                out += container_problems(f"{name} {where}/{c['name']}", c, volumes, configmaps)
                if ray_params is not None and i > 0:  # KubeRay's Ray container is the first
                    out += sidecar_problems(f"{name} {where}/{c['name']}", pod, c)
        if doc["kind"] == "RayCluster":
            out += job_slot_problems(name, doc)
        if doc["kind"] == "RayJob":
            out += command_problems(f"{name} entrypoint", shlex.split(doc["spec"]["entrypoint"]), docs_mounts(doc), configmaps)
        if doc["kind"] == "Service":
            out += service_problems(name, doc, docs)
    return out


def ray_resources(ray_params: dict) -> dict:
    """A node's custom resources from KubeRay's rayStartParams.resources (a quoted JSON object)."""
    text = ray_params.get("resources")
    if not text:
        return {}
    value = json.loads(text)
    return json.loads(value) if isinstance(value, str) else value


def job_slot_problems(name: str, doc: dict) -> list[str]:
    """A cluster that runs `lockstep worker` offers the job slots the scheduler counts: a worker
    joining a cluster cannot add resources (its --job-slots only sizes a Ray it starts itself)."""
    nodes = list(pods(doc))
    workers = [c.get("args", []) for _, pod, _, _ in nodes for c in pod["containers"]
               if c.get("command") == ["lockstep"] and c.get("args", [])[:1] == ["worker"]]
    if not workers:
        return []
    offered = sum(ray_resources(params or {}).get(SLOT, 0) * replicas for _, _, params, replicas in nodes)
    out = [] if offered else [f"{name}: no node offers {SLOT} (rayStartParams.resources): the worker would start no job"]
    for argv in workers:
        if "--job-slots" in argv and offered and int(argv[argv.index("--job-slots") + 1]) != offered:
            out.append(f"{name}: the worker's --job-slots {argv[argv.index('--job-slots') + 1]} is not the {offered:g} "
                       f"{SLOT} the nodes offer (the nodes' count is the one used)")
    return out


def service_problems(name: str, svc: dict, docs: list[dict]) -> list[str]:
    """A Service selects the head of a RayCluster of deploy/ or a StatefulSet's pods, on a port they listen on."""
    sel = svc["spec"]["selector"]
    for doc in docs:
        if doc["kind"] == "RayCluster" and sel == {"ray.io/cluster": doc["metadata"]["name"], "ray.io/node-type": "head"}:
            pod = doc["spec"]["headGroupSpec"]["template"]["spec"]
        elif doc["kind"] == "StatefulSet" and sel.items() <= doc["spec"]["template"]["metadata"].get("labels", {}).items():
            pod = doc["spec"]["template"]["spec"]
        else:
            continue
        listening = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
        return [f"{name}: port {p.get('targetPort', p['port'])} is not a containerPort of the pods it selects"
                for p in svc["spec"]["ports"] if p.get("targetPort", p["port"]) not in listening]
    return [f"{name}: selects {sel}, neither the head of a RayCluster nor a StatefulSet's pods in deploy/"]


def docs_mounts(doc: dict) -> dict[str, str]:
    """Mount path -> ConfigMap name of the head's config mounts (where a RayJob's driver runs)."""
    head = next(p for w, p, _, _ in pods(doc) if w == "head")
    volumes = {v["name"]: v for v in head.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]]["configMap"]["name"] for c in head["containers"]
            for m in c.get("volumeMounts", []) if "configMap" in volumes.get(m["name"], {})}


def container_problems(where: str, c: dict, volumes: dict, configmaps: dict) -> list[str]:
    out = []
    for m in c.get("volumeMounts", []):
        if m["name"] not in volumes:
            out.append(f"{where}: mounts volume {m['name']!r}, which the pod does not define")
    res = c.get("resources", {})
    for key, limit in res.get("limits", {}).items():
        if key in res.get("requests", {}) and quantity(res["requests"][key]) > quantity(limit):
            out.append(f"{where}: requests more {key} than its limit")
    env = {e["name"] for e in c.get("env", [])}
    argv = c.get("command", []) + c.get("args", [])
    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(argv)):
        if ref not in env:
            out.append(f"{where}: $({ref}) is not an env var of the container")
    if argv[:1] == ["lockstep"]:
        mounts = {m["mountPath"]: volumes[m["name"]]["configMap"]["name"] for m in c.get("volumeMounts", [])
                  if "configMap" in volumes.get(m["name"], {})}
        out += command_problems(where, argv, mounts, configmaps)
    return out


def sidecar_problems(where: str, pod: dict, c: dict) -> list[str]:
    """A Ray driver in a container beside the Ray container (`lockstep worker --ray-address ...`)
    talks to the raylet through its Unix sockets under /tmp/ray and, from Ray 2.55, finds it by
    scanning the processes it can see (ray/_private/services.py find_node_ids; Ray issue 63923):
    so the two containers share /tmp/ray and the pod shares one process namespace. It names the
    head by a routable address: lockstep treats a loopback one as a single-machine Ray."""
    argv = c.get("command", []) + c.get("args", [])
    if argv[:1] != ["lockstep"] or "--ray-address" not in argv:
        return []
    out = []
    ray_tmp = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}.get(RAY_TMP)
    if ray_tmp is None or not any(m["name"] == ray_tmp and m["mountPath"] == RAY_TMP for m in c.get("volumeMounts", [])):
        out.append(f"{where}: a Ray driver beside the Ray container without its {RAY_TMP} (one emptyDir "
                   f"mounted at {RAY_TMP} in both): it cannot reach the raylet's sockets")
    if not pod.get("shareProcessNamespace"):
        out.append(f"{where}: a Ray driver in a sidecar needs shareProcessNamespace: true (Ray >= 2.55 finds "
                   "the node's raylet among the processes it can see)")
    address = argv[argv.index("--ray-address") + 1]
    if address != "auto" and is_loopback(address):
        out.append(f"{where}: --ray-address {address} is loopback, which lockstep runs as a single-machine Ray "
                   "(raylocal.py); give the head's pod address ($(POD_IP) from status.podIP) or auto")
    return out


def command_problems(where: str, argv: list[str], mounts: dict, configmaps: dict) -> list[str]:
    """A `lockstep` command line must parse with the CLI; a run's config file must load."""
    if argv[:1] != ["lockstep"]:
        return [f"{where}: runs {argv[:1]}, not lockstep"]
    try:
        args = parser().parse_args(argv[1:])
    except SystemExit:
        return [f"{where}: `{' '.join(argv)}` does not parse with the lockstep CLI"]
    out = []
    if args.command in ("run", "worker", "serve") and getattr(args, "ray_address", None) is None and "--no-worker" not in argv:
        out.append(f"{where}: no --ray-address: it would start a private Ray instead of joining the cluster")
    if args.command == "run":
        config = Path(args.config)
        cm = mounts.get(str(config.parent))
        if cm is None or config.name not in configmaps.get(cm, {}):
            return out + [f"{where}: config {config} is not a key of a ConfigMap mounted at {config.parent}"]
        out += [f"{where}: {e}" for e in config_problems(configmaps[cm][config.name])]
    return out


@functools.cache
def config_problems(text: str) -> tuple[str, ...]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        try:
            load(f.name)
        except Exception as e:  # noqa: BLE001 - any load error is the finding
            return (f"the run config does not load: {e}",)
    return ()


# -- storage: who writes where ---------------------------------------------------------------
def image_user(dockerfile: str) -> tuple[int, int] | None:
    """The numeric uid:gid of the Dockerfile's last USER (None when it names no numbers)."""
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    m = re.fullmatch(r"(\d+):(\d+)", users[-1]) if users else None
    return (int(m[1]), int(m[2])) if m else None


def storage_problems(d: Deploy) -> list[str]:
    """Claims exist; a single-writer (ReadWriteOnce) claim is mounted by one pod, with one replica;
    in a Ray cluster whose containers mount a claim, every node that can host actors (num-cpus not
    "0") mounts it at the same path in its Ray container, since the run's actors read the model
    and write checkpoints and envs.log by the driver's paths; a pod of our image that mounts a
    claim gives it the image's group (fsGroup) and runs as the image's user."""
    out = []
    claims = {doc["metadata"]["name"]: doc["spec"]["accessModes"] for doc in d.docs if doc["kind"] == "PersistentVolumeClaim"}
    mounted_by: dict[str, list[str]] = {}
    user = image_user(d.dockerfile)
    if user is None:
        out.append("deploy/Dockerfile: the last USER is not numeric uid:gid, so no manifest can name its group in fsGroup")
    for doc in d.docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        data_paths: dict[str, str] = {}
        ray_nodes = []
        for where, pod, ray_params, replicas in pods(doc):
            volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
            for claim in volumes.values():
                mounted_by.setdefault(claim, []).append(f"{name} {where}")
                if claim not in claims:
                    out.append(f"{name} {where}: claim {claim} is not a PersistentVolumeClaim in deploy/")
                elif SINGLE_WRITER & set(claims[claim]) and replicas != 1:
                    out.append(f"{name} {where}: ReadWriteOnce claim {claim} in a pod template of up to {replicas} "
                               "pods: only one pod can write it")
            ours = [c for c in pod["containers"] if c["image"].startswith("lockstep:")]
            if volumes and ours and user is not None:
                sc = pod.get("securityContext", {})
                if sc.get("fsGroup") != user[1] or sc.get("runAsUser", user[0]) != user[0]:
                    out.append(f"{name} {where}: securityContext {sc} does not give the image's user {user[0]}:{user[1]} "
                               f"its volumes (fsGroup: {user[1]}, runAsUser: {user[0]})")
            for c in ours:
                for m in c.get("volumeMounts", []):
                    if m["name"] in volumes:
                        data_paths.setdefault(volumes[m["name"]], m["mountPath"])
            if ray_params is not None:
                ray_nodes.append((where, pod, ray_params))
        for claim, path in data_paths.items():
            for where, pod, ray_params in ray_nodes:
                if ray_params.get("num-cpus") == "0":
                    continue
                ray_c = pod["containers"][0]
                claim_of = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
                if not any(claim_of.get(m["name"]) == claim and m["mountPath"] == path for m in ray_c.get("volumeMounts", [])):
                    out.append(f"{name} {where}/{ray_c['name']}: hosts the run's actors but does not mount claim {claim} "
                               f"at {path}: they would read models and write checkpoints on the pod's own disk")
    for claim, users in mounted_by.items():
        if claim in claims and SINGLE_WRITER & set(claims[claim]) and len(users) > 1:
            out.append(f"ReadWriteOnce claim {claim} is mounted by {', '.join(users)}: one pod only, or make it ReadWriteMany")
    return out


# -- the image: its Ray, its extras, its build context ---------------------------------------------
def pinned_ray(constraints: str) -> str | None:
    for line in constraints.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            if req.name == "ray" and len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==":
                return next(iter(req.specifier)).version
    return None


def ray_version_problems(d: Deploy) -> list[str]:
    """One Ray: deploy/constraints.txt pins it; the tests run with it; setup.sh and the image
    install under it; the image starts from Ray's image of it; every rayVersion names it."""
    ray = pinned_ray(d.constraints)
    if ray is None:
        return ["deploy/constraints.txt: no `ray==X.Y.Z` pin"]
    out = []
    tested = importlib.metadata.version("ray")
    if tested != ray:
        out.append(f"deploy/constraints.txt pins ray {ray} but the tests run with {tested}: run scripts/setup.sh")
    base = re.search(r"^FROM\s+rayproject/ray:(\S+)", d.dockerfile, re.MULTILINE)
    if not base or not base[1].startswith(f"{ray}-py311-"):
        out.append(f"deploy/Dockerfile: FROM rayproject/ray:{base[1] if base else '?'}, not the pinned {ray}-py311-*")
    if not re.search(r"pip install[^\n]*-c \S*deploy/constraints\.txt", d.dockerfile):
        out.append("deploy/Dockerfile: lockstep is not installed under deploy/constraints.txt (pip could swap Ray)")
    if not re.search(r"pip install[^\n]*-c deploy/constraints\.txt", d.setup_sh):
        out.append("scripts/setup.sh: does not install under deploy/constraints.txt, so the tests' Ray may differ")
    for doc in d.docs:
        spec = doc["spec"].get("rayClusterSpec", doc["spec"]) if doc["kind"] in ("RayCluster", "RayJob") else None
        if spec is not None and spec.get("rayVersion") != ray:
            out.append(f"{doc['kind']}/{doc['metadata']['name']}: rayVersion {spec.get('rayVersion')!r}, not the pinned {ray}")
    return out


def driver_modules(d: Deploy) -> dict[str, str]:
    """Module -> the URL that needs it: the store's SQLAlchemy driver (the guide's db-url) and
    fsspec's implementation of every storage scheme a lockstep command names."""
    from fsspec.registry import known_implementations

    need = {}
    for url in re.findall(r"db-url=\"?([a-z0-9+]+://[^\s\"]+)", d.guide):
        dialect = urlsplit(url).scheme
        if "+" in dialect:
            need[dialect.split("+", 1)[1]] = url
    storage = [argv[i + 1] for doc in d.docs for _, pod, _, _ in pods(doc) for c in pod["containers"]
               for argv in [c.get("args", [])] for i, x in enumerate(argv[:-1]) if x == "--storage"]
    for url in storage + ["s3://bucket/prefix"]:  # s3: the scheme the guide offers as the alternative to the volume
        scheme = urlsplit(url).scheme
        if scheme:
            need[known_implementations[scheme]["class"].split(".")[0]] = url
    return need


def extras_problems(d: Deploy) -> list[str]:
    """The `server` extra holds the drivers of the URLs the deployment uses, `dev` installs it
    (the tests use them), and the image installs lockstep with it."""
    extras = d.pyproject["project"].get("optional-dependencies", {})
    server = {Requirement(r).name for r in extras.get("server", [])}
    out = [f"pyproject.toml: the server extra lacks {module} (for {url})" for module, url in driver_modules(d).items()
           if module not in server]
    if not any(Requirement(r).name == "lockstep" and "server" in Requirement(r).extras for r in extras.get("dev", [])):
        out.append("pyproject.toml: dev does not install lockstep[server]")
    if not re.search(r"pip install[^\n]*/home/ray/lockstep\[server\]", d.dockerfile):
        out.append("deploy/Dockerfile: lockstep is installed without its server extra")
    return out


JUNK = [".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/lib/x.so", "runs/r1/metrics.jsonl", ".git/HEAD",
        "build/lib/x.py", "dist/lockstep-0.1.0.whl", "src/lockstep.egg-info/PKG-INFO", "src/lockstep/__pycache__/cli.cpython-311.pyc",
        "src/lockstep/engine/kernels/_build/fused.so", ".pytest_cache/v/cache/nodeids", "bench/results/x.json", "bench/.models/m/config.json"]
"""What a checkout accumulates and an image must not get."""


def dockerignore_problems(d: Deploy) -> list[str]:
    return list(context_problems(d.dockerignore, d.pyproject["project"].get("readme", "README.md")))


@functools.cache
def context_problems(dockerignore: str, readme: str) -> tuple[str, ...]:
    """Docker's own matching (docker-py's exclude_paths) over a checkout's files plus JUNK: none of
    JUNK goes into the build context, and everything the install needs does (pyproject.toml, its
    readme, every file of src/ that git would keep, the constraints the Dockerfile installs under)."""
    import tempfile

    patterns = [ln.strip() for ln in dockerignore.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    needed = {"pyproject.toml", readme, "deploy/constraints.txt"}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and "_build" not in p.parts and ".egg-info" not in str(p)}
    with tempfile.TemporaryDirectory() as root:
        for rel in needed | set(JUNK):
            (Path(root) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(root) / rel).write_text("x")
        sent = set(exclude_paths(root, patterns))
    return tuple([f".dockerignore: {j} would go into the image" for j in JUNK if j in sent]
                 + [f".dockerignore: {n} is needed by the install but left out" for n in sorted(needed - sent)])


# -- the guide's commands ------------------------------------------------------------------------
def guide_commands(guide: str) -> list[str]:
    """The shell commands of docs/deploy.md's bash blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", guide, re.DOTALL):
        out += [ln.strip() for ln in block.replace("\\\n", " ").splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return out


def expanded_here(text: str) -> list[str]:
    """The $variables that the laptop's shell expands in `text` (outside single quotes)."""
    out, single, double, i = [], False, False, 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and not single:
            i += 2
            continue
        if ch == "'" and not double:
            single = not single
        elif ch == '"' and not single:
            double = not double
        elif ch == "$" and not single:
            out.append(re.match(r"\$\{?[A-Za-z_(][A-Za-z0-9_]*", text[i:])[0] if re.match(r"\$\{?[A-Za-z_(]", text[i:]) else "$")
        i += 1
    return out


def guide_problems(d: Deploy) -> list[str]:
    """Files the guide applies exist; what runs in a pod (after `kubectl exec ... --`) expands its
    variables there (inside sh -c '...'), reads only the container's env, and parses with the
    CLI; every Secret key the manifests read is created by the guide; the db-url names a Service
    of deploy/ and the user and database its PostgreSQL creates."""
    out = []
    commands = guide_commands(d.guide)
    containers = {c["name"]: c for doc in d.docs for _, pod, _, _ in pods(doc) for c in pod["containers"]}
    for cmd in commands:
        for path in re.findall(r"kubectl (?:apply|create) -f (\S+)", cmd):
            if path != "-" and path not in d.files:
                out.append(f"docs/deploy.md: `{cmd}` applies {path}, which does not exist")
        if cmd.startswith("kubectl exec") and " -- " in cmd:
            local, remote = cmd.split(" -- ", 1)
            if expanded_here(remote):
                out.append(f"docs/deploy.md: `{cmd}`: {', '.join(expanded_here(remote))} would expand on the laptop; "
                           "quote what runs in the pod: -- sh -c '...'")
                continue
            argv = shlex.split(remote, comments=True)
            script = shlex.split(argv[2]) if argv[:2] == ["sh", "-c"] else argv
            name = re.search(r"-c (\S+)", local)
            env = {e["name"] for e in containers.get(name[1] if name else "", {}).get("env", [])}
            for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", " ".join(script)):
                if var not in env:
                    out.append(f"docs/deploy.md: `{cmd}`: ${var} is not an env var of that container")
            if script[:1] == ["lockstep"]:
                try:
                    parser().parse_args(script[1:])
                except SystemExit:
                    out.append(f"docs/deploy.md: `{cmd}` does not parse with the lockstep CLI")
    created = {(m[0], k) for cmd in commands for m in re.findall(r"kubectl create secret generic (\S+)(.*)", cmd)
               for k in re.findall(r"--from-literal=([A-Za-z0-9_.-]+)=", m[1])}
    for doc in d.docs:
        for _, pod, _, _ in pods(doc):
            for c in pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref and (ref["name"], ref["key"]) not in created:
                        out.append(f"{doc['kind']}/{doc['metadata']['name']} {c['name']}: reads Secret {ref['name']} "
                                   f"key {ref['key']}, which docs/deploy.md never creates")
    return out + database_problems(d)


def database_problems(d: Deploy) -> list[str]:
    out = []
    services = {doc["metadata"]["name"]: doc for doc in d.docs if doc["kind"] == "Service"}
    for url in re.findall(r"db-url=\"?(postgresql[a-z0-9+]*://[^\s\"]+)", d.guide):
        u = urlsplit(url)
        svc = services.get(u.hostname)
        if svc is None or (u.port or 5432) not in {p["port"] for p in svc["spec"]["ports"]}:
            out.append(f"docs/deploy.md: db-url host {u.hostname}:{u.port} is not a Service port of deploy/")
            continue
        for doc in d.docs:
            if doc["kind"] == "StatefulSet" and svc["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items():
                env = {e["name"]: e.get("value") for c in doc["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
                if (env.get("POSTGRES_USER"), env.get("POSTGRES_DB")) != (u.username, u.path.lstrip("/")):
                    out.append(f"docs/deploy.md: db-url user/database {u.username}/{u.path.lstrip('/')} are not the "
                               f"{env.get('POSTGRES_USER')}/{env.get('POSTGRES_DB')} that StatefulSet/{doc['metadata']['name']} creates")
    return out


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_is_valid_alone(path):
    docs = documents(path)
    assert docs and schema_problems(docs) == []


def test_deploy_as_a_whole_is_consistent():
    assert problems(current()) == []


def test_both_entry_points_and_a_database_are_deployed():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in current().docs}
    assert {("RayJob", "lockstep-run"), ("RayCluster", "lockstep-service"), ("StatefulSet", "lockstep-postgres"),
            ("Service", "lockstep-postgres")} <= kinds
    assert (ROOT / "deploy" / "Dockerfile").is_file() and (ROOT / "docs" / "deploy.md").is_file()


def edited(edit) -> list[str]:
    """problems() of a copy of deploy/ changed by `edit`."""
    d = current()
    d = edit(d) or d
    return problems(d)


def find(d: Deploy, kind: str, name: str) -> dict:
    return next(doc for doc in d.docs if doc["kind"] == kind and doc["metadata"]["name"] == name)


def serve_head(d: Deploy) -> dict:
    return find(d, "RayCluster", "lockstep-service")["spec"]["headGroupSpec"]["template"]["spec"]


def job_cluster(d: Deploy) -> dict:
    return find(d, "RayJob", "lockstep-run")["spec"]["rayClusterSpec"]


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def test_the_check_finds_what_a_cluster_would_reject_or_run_wrongly():
    def typo(d):
        cluster = find(d, "RayCluster", "lockstep-service")["spec"]
        cluster["headGroupSpecs"] = cluster.pop("headGroupSpec")
    assert any("headGroupSpec" in p for p in edited(typo))

    def int_param(d):
        find(d, "RayCluster", "lockstep-service")["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert any("rayStartParams" in p for p in edited(int_param))

    def bad_flag(d):
        find(d, "RayJob", "lockstep-run")["spec"]["entrypoint"] += " --gpus 8"
    assert any("does not parse" in p for p in edited(bad_flag))

    def bad_config(d):
        find(d, "ConfigMap", "lockstep-run-config")["data"]["run.toml"] += "\n[rollout.fork]\nbranches = 1\n"
    assert any("rollout.fork.branches" in p for p in edited(bad_config))

    def lost_mount(d):
        job_cluster(d)["headGroupSpec"]["template"]["spec"]["volumes"].pop(0)
    found = edited(lost_mount)
    assert any("does not define" in p for p in found) and any("not a key of a ConfigMap" in p for p in found)

    def env_ref(d):
        container(serve_head(d), "lockstep-worker")["env"] = []
    assert any("$(LOCKSTEP_DB) is not an env var" in p for p in edited(env_ref))

    def wrong_selector(d):
        find(d, "Service", "lockstep-postgres")["spec"]["selector"] = {"app": "postgres"}
    assert any("neither the head of a RayCluster nor a StatefulSet" in p for p in edited(wrong_selector))


def test_the_check_finds_a_worker_that_cannot_reach_ray():
    def no_shared_tmp(d):
        c = container(serve_head(d), "lockstep-worker")
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != RAY_TMP]
    assert any("without its /tmp/ray" in p for p in edited(no_shared_tmp))

    def own_pid_namespace(d):
        del serve_head(d)["shareProcessNamespace"]
    assert any("shareProcessNamespace" in p for p in edited(own_pid_namespace))

    def no_job_slots(d):  # as it was: --job-slots alone, which a worker joining a cluster cannot add
        del find(d, "RayCluster", "lockstep-service")["spec"]["headGroupSpec"]["rayStartParams"]["resources"]
    assert any("no node offers lockstep_job_slots" in p for p in edited(no_job_slots))

    def two_counts(d):
        args = container(serve_head(d), "lockstep-worker")["args"]
        args[args.index("--job-slots") + 1] = "8"
    assert any("--job-slots 8 is not the 4 lockstep_job_slots" in p for p in edited(two_counts))

    def loopback(d):  # the address the manifest had: lockstep makes it a single-machine Ray
        args = container(serve_head(d), "lockstep-worker")["args"]
        args[args.index("--ray-address") + 1] = "127.0.0.1:6379"
    assert any("is loopback" in p for p in edited(loopback))


def test_the_check_finds_storage_a_default_class_cannot_give_or_the_user_cannot_write():
    def worker_group_without_the_volume(d):  # the manifests' old worker pods, actors writing their own disks
        job_cluster(d)["workerGroupSpecs"] = [{"groupName": "cpu", "replicas": 2, "minReplicas": 1, "maxReplicas": 4,
            "rayStartParams": {"num-cpus": "8"}, "template": {"spec": {"containers": [{"name": "ray-worker", "image": "lockstep:0.1.0"}]}}}]
    assert any("hosts the run's actors but does not mount claim lockstep-runs" in p for p in edited(worker_group_without_the_volume))

    def worker_group_sharing_rwo(d):
        worker_group_without_the_volume(d)
        pod = job_cluster(d)["workerGroupSpecs"][0]["template"]["spec"]
        pod["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "lockstep-runs"}}]
        pod["securityContext"] = {"fsGroup": 100}
        pod["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data/lockstep"}]
    assert any("only one pod can write it" in p for p in edited(worker_group_sharing_rwo))

    def two_clusters_one_claim(d):
        find(d, "RayCluster", "lockstep-service")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"][0][
            "persistentVolumeClaim"]["claimName"] = "lockstep-runs"
    assert any("ReadWriteOnce claim lockstep-runs is mounted by" in p for p in edited(two_clusters_one_claim))

    def executor_without_the_volume(d):  # ray-head runs the Executor, which writes checkpoints to storage
        c = container(serve_head(d), "ray-head")
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "data"]
    assert any("ray-head: hosts the run's actors but does not mount claim lockstep-service-data" in p
               for p in edited(executor_without_the_volume))

    def no_fs_group(d):
        del serve_head(d)["securityContext"]
    assert any("does not give the image's user 1000:100" in p for p in edited(no_fs_group))

    def named_user(d):
        d.dockerfile = d.dockerfile.replace("USER 1000:100", "USER ray")
    assert any("USER is not numeric" in p for p in edited(named_user))

    def missing_claim(d):
        d.docs = [doc for doc in d.docs if doc["kind"] != "PersistentVolumeClaim"]
    assert any("is not a PersistentVolumeClaim in deploy/" in p for p in edited(missing_claim))


def test_the_check_finds_an_image_without_the_tested_ray_or_the_drivers():
    def old_ray_version(d):
        job_cluster(d)["rayVersion"] = "2.49.0"
    assert any("rayVersion '2.49.0', not the pinned" in p for p in edited(old_ray_version))

    def old_base_image(d):
        d.dockerfile = re.sub(r"rayproject/ray:\S+", "rayproject/ray:2.49.0-py311-cpu", d.dockerfile)
    assert any("FROM rayproject/ray:2.49.0-py311-cpu, not the pinned 2.60.0-py311-*" in p for p in edited(old_base_image))

    def unpinned(d):
        d.setup_sh = d.setup_sh.replace("-c deploy/constraints.txt ", "")
        d.dockerfile = d.dockerfile.replace("-c /home/ray/lockstep/deploy/constraints.txt ", "")
    found = edited(unpinned)
    assert any("scripts/setup.sh" in p for p in found) and any("could swap Ray" in p for p in found)

    def pin_another(d):
        d.constraints = "ray==2.49.0\n"
    assert any("but the tests run with" in p for p in edited(pin_another))

    def driver_only_in_dev(d):  # as it was: psycopg in dev only, a plain pip install in the image
        extras = d.pyproject["project"]["optional-dependencies"]
        extras["server"] = [r for r in extras["server"] if not r.startswith("psycopg")]
        d.dockerfile = d.dockerfile.replace("/home/ray/lockstep[server]", "/home/ray/lockstep")
    found = edited(driver_only_in_dev)
    assert any("server extra lacks psycopg" in p for p in found) and any("without its server extra" in p for p in found)

    def no_s3_driver(d):
        extras = d.pyproject["project"]["optional-dependencies"]
        extras["server"] = [r for r in extras["server"] if not r.startswith("s3fs")]
    assert any("server extra lacks s3fs" in p for p in edited(no_s3_driver))

    def dev_without_server(d):
        extras = d.pyproject["project"]["optional-dependencies"]
        extras["dev"] = [r for r in extras["dev"] if not r.startswith("lockstep[")]
    assert any("dev does not install lockstep[server]" in p for p in edited(dev_without_server))


def test_the_check_finds_a_build_context_with_junk_or_without_the_sources():
    def none(d):  # no .dockerignore, as it was: .venv, runs/ and .git go in
        d.dockerignore = ""
    found = edited(none)
    assert {".dockerignore: .venv/bin/python would go into the image", ".dockerignore: runs/r1/metrics.jsonl would go into the image",
            ".dockerignore: .git/HEAD would go into the image"} <= set(found)

    def too_much(d):
        d.dockerignore += "\n*.md\n"
    assert ".dockerignore: README.md is needed by the install but left out" in edited(too_much)


def test_the_check_finds_guide_commands_that_do_not_run_as_written():
    def laptop_expansion(d):  # the guide's old line: $LOCKSTEP_DB expanded by the laptop's shell
        d.guide = d.guide.replace("""-- sh -c 'lockstep tenants create alice --db "$LOCKSTEP_DB"'""",
                                  """-- lockstep tenants create alice --db "$LOCKSTEP_DB\"""")
    assert any("$LOCKSTEP_DB would expand on the laptop" in p for p in edited(laptop_expansion))

    def wrong_container(d):
        d.guide = d.guide.replace("-c lockstep-api -- sh -c 'lockstep tenants", "-c ray-head -- sh -c 'lockstep tenants")
    assert any("$LOCKSTEP_DB is not an env var of that container" in p for p in edited(wrong_container))

    def missing_secret(d):
        d.guide = re.sub(r"kubectl create secret generic lockstep-postgres[^\n]*\n", "", d.guide)
    assert any("reads Secret lockstep-postgres key password, which docs/deploy.md never creates" in p for p in edited(missing_secret))

    def wrong_host(d):
        d.guide = d.guide.replace("@lockstep-postgres:5432/", "@postgres:5432/")
    assert any("db-url host postgres:5432 is not a Service port" in p for p in edited(wrong_host))

    def wrong_database(d):
        d.guide = d.guide.replace("@lockstep-postgres:5432/lockstep", "@lockstep-postgres:5432/tinker")
    assert any("db-url user/database lockstep/tinker" in p for p in edited(wrong_database))

    def missing_file(d):
        d.files.discard("deploy/kuberay/postgres.yaml")
    assert any("applies deploy/kuberay/postgres.yaml, which does not exist" in p for p in edited(missing_file))


@pytest.mark.slow  # two Ray imports in subprocesses: seconds, many under load
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare (a new PID namespace)")
def test_the_pinned_ray_finds_its_raylet_only_among_the_processes_it_sees():
    """Why a sidecar driver needs shareProcessNamespace: the installed Ray's node discovery (what
    ray.init uses to pick the raylet to join) sees a raylet in its own PID namespace and none from
    a new one, as a container of a pod sees by default. If a Ray release stops needing it, this
    fails, and sidecar_problems can drop that requirement."""
    node_id = uuid.uuid4().hex
    check = "from ray._private.services import find_node_ids; print(' '.join(sorted(find_node_ids())))"
    fake = subprocess.Popen(["/opt/raylet", "-c", "import sys; print('up', flush=True); sys.stdin.read()", f"--node_id={node_id}"],
                            executable=sys.executable, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline() == "up\n"  # running, under the raylet's name and flag
        seen = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout.split()
        isolated = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", check],
                                  capture_output=True, text=True, check=False)
    finally:
        fake.stdin.close()
        fake.wait()
    assert node_id in seen
    if isolated.returncode != 0 and "Operation not permitted" in isolated.stderr:
        pytest.skip(f"no new PID namespace here: {isolated.stderr.strip()}")
    assert isolated.returncode == 0, isolated.stderr
    assert node_id not in isolated.stdout.split()
