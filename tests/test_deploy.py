"""deploy/: the KubeRay manifests, checked offline. Each document is validated against a schema of
the fields KubeRay v1 and Kubernetes accept (tests/data/kuberay_v1.schema.json, unknown fields
refused), then for what kubectl cannot see: every `lockstep` command line parses with the real CLI,
the run config in the ConfigMap loads, mounts name volumes that exist, ConfigMaps and env
references resolve, replica bounds and resources are consistent, the Service selects the head."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from lockstep.cli import build_parser
from lockstep.config import load

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
SCHEMA = json.loads((Path(__file__).parent / "data" / "kuberay_v1.schema.json").read_text())
BY_KIND = {branch["properties"]["kind"]["const"]: jsonschema.Draft202012Validator(
    {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], **branch}) for branch in SCHEMA["oneOf"]}
"""One validator per kind, so that an error names the field rather than "matches none of the kinds"."""
UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def quantity(q: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", q).groups()
    return float(number) * UNITS[unit]


def pods(doc: dict):
    """(where, pod spec, rayStartParams) of every pod template in a RayCluster or RayJob."""
    spec = doc["spec"].get("rayClusterSpec", doc["spec"]) if doc["kind"] in ("RayCluster", "RayJob") else None
    if not spec or "headGroupSpec" not in spec:
        return
    yield "head", spec["headGroupSpec"]["template"]["spec"], spec["headGroupSpec"].get("rayStartParams", {})
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]["spec"], group.get("rayStartParams", {})


def problems(docs: list[dict]) -> list[str]:
    """Everything wrong with one file's documents (empty: it is fine)."""
    out = []
    for doc in docs:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind not in BY_KIND:
            out.append(f"{kind}: not a kind deploy/ uses ({sorted(BY_KIND)}); extend the schema")
            continue
        for error in BY_KIND[kind].iter_errors(doc):
            out.append(f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}: schema: "
                       f"{'/'.join(map(str, error.absolute_path))}: {error.message[:200]}")
    if out:
        return out
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    clusters = {d["metadata"]["name"] for d in docs if d["kind"] == "RayCluster"}
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        groups = doc["spec"].get("rayClusterSpec", doc["spec"]).get("workerGroupSpecs", []) if doc["kind"] != "Service" and "spec" in doc else []
        if len({g["groupName"] for g in groups}) != len(groups):
            out.append(f"{name}: worker group names repeat")
        for g in groups:
            lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 2**31)
            if not lo <= n <= hi:
                out.append(f"{name}: group {g['groupName']}: replicas {n} outside [{lo}, {hi}]")
        for where, pod, _ in pods(doc):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for v in volumes.values():
                if "configMap" in v and v["configMap"]["name"] not in configmaps:
                    out.append(f"{name} {where}: volume {v['name']} names ConfigMap {v['configMap']['name']}, not in this file")
            for c in pod["containers"]:
                out += container_problems(f"{name} {where}/{c['name']}", c, volumes, configmaps)
        if doc["kind"] == "RayJob":
            out += command_problems(f"{name} entrypoint", shlex.split(doc["spec"]["entrypoint"]), {}, docs_mounts(doc), configmaps)
        if doc["kind"] == "Service":
            sel = doc["spec"]["selector"]
            if sel.get("ray.io/cluster") not in clusters or sel.get("ray.io/node-type") != "head":
                out.append(f"{name}: selects {sel}, not the head of a RayCluster in this file")
    return out


def docs_mounts(doc: dict) -> dict[str, dict]:
    """Mount path -> ConfigMap name of the head's config mounts (where a RayJob's driver runs)."""
    head = next(p for w, p, _ in pods(doc) if w == "head")
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
        out += command_problems(where, argv, env, mounts, configmaps)
    return out


def command_problems(where: str, argv: list[str], env: set, mounts: dict, configmaps: dict) -> list[str]:
    """A `lockstep` command line must parse with the CLI; a run's config file must load."""
    if argv[:1] != ["lockstep"]:
        return [f"{where}: runs {argv[:1]}, not lockstep"]
    try:
        args = build_parser().parse_args(argv[1:])
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


def config_problems(text: str) -> list[str]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        try:
            load(f.name)
        except Exception as e:  # noqa: BLE001 - any load error is the finding
            return [f"the run config does not load: {e}"]
    return []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_are_valid(path):
    docs = documents(path)
    assert docs and problems(docs) == []


def test_both_entry_points_are_deployed():
    kinds = {(d["kind"], d["metadata"]["name"]) for p in MANIFESTS for d in documents(p)}
    assert ("RayJob", "lockstep-run") in kinds and ("RayCluster", "lockstep-service") in kinds
    assert (ROOT / "deploy" / "Dockerfile").is_file() and (ROOT / "docs" / "deploy.md").is_file()


def broken(path: str, edit) -> list[str]:
    docs = documents(ROOT / "deploy" / "kuberay" / path)
    docs = copy.deepcopy(docs)
    edit(docs)
    return problems(docs)


def test_the_check_finds_what_a_cluster_would_reject_or_run_wrongly():
    def typo(docs):
        cluster = docs[0]["spec"]
        cluster["workerGroupSpec"] = cluster.pop("workerGroupSpecs")
    assert any("workerGroupSpec" in p for p in broken("raycluster-serve.yaml", typo))

    def int_param(docs):
        docs[0]["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # KubeRay wants strings
    assert any("rayStartParams" in p for p in broken("raycluster-serve.yaml", int_param))

    def bad_flag(docs):
        docs[1]["spec"]["entrypoint"] += " --gpus 8"
    assert any("does not parse" in p for p in broken("rayjob-run.yaml", bad_flag))

    def bad_config(docs):
        docs[0]["data"]["run.toml"] += "\n[rollout.fork]\nbranches = 1\n"
    assert any("rollout.fork.branches" in p for p in broken("rayjob-run.yaml", bad_config))

    def lost_mount(docs):
        docs[1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"].pop(0)
    found = broken("rayjob-run.yaml", lost_mount)
    assert any("does not define" in p for p in found) and any("not a key of a ConfigMap" in p for p in found)

    def replicas(docs):
        docs[0]["spec"]["workerGroupSpecs"][0]["replicas"] = 20
    assert any("outside [1, 8]" in p for p in broken("raycluster-serve.yaml", replicas))

    def env_ref(docs):
        docs[0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][2]["env"] = []
    assert any("$(LOCKSTEP_DB) is not an env var" in p for p in broken("raycluster-serve.yaml", env_ref))
