"""deploy/k8s validated offline (no cluster runs them in CI): every core/apps object against
the `kubernetes` client's models (unknown fields refused at any depth, required fields
present), the Gateway API objects against the schema the repository vendors
(deploy/k8s/schemas/gaie-v1.yaml), the kustomizations naming exactly the files there, and
each ConfigMap's kvloop `--config` YAML parsed by its command's parser."""

from __future__ import annotations

import datetime
import functools
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

from kvloop.cli import _expand_config, build_parser

from .pki_helpers import write_pki

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
SCHEMA = yaml.safe_load((K8S / "schemas" / "gaie-v1.yaml").read_text())
CORE_GROUPS = {"v1": "V1", "apps/v1": "V1"}
PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,),
                                           "float": (int, float), "object": (object,),
                                           "datetime": (str, datetime.datetime), "bytes": (str,)}
NATS_CA_DIR = "/etc/kvloop-nats-tls"
COMMAND_OF = {"worker.yaml": "serve", "router.yaml": "router", "epp.yaml": "router"}


@functools.cache
def k8s_client() -> ModuleType:
    """`kubernetes.client` (its models and ApiClient), imported by the first test that needs
    it: importing the kubernetes package costs a fifth of a second, which every pytest-xdist
    worker would pay at collection."""
    pytest.importorskip("kubernetes")
    import kubernetes.client

    return kubernetes.client


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*/*.yaml")):
        if path.name == "kustomization.yaml" or path.parent.name == "schemas":
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            out.append((f"{path.relative_to(K8S)}#{i}", doc))
    return out


MANIFESTS = manifests()


def check_model(data: Any, type_name: str, where: str) -> None:
    """`data` is a valid `type_name` of the kubernetes client: only the model's fields, each
    of its declared type, all the way down."""
    if type_name.startswith(("list[", "List[")):
        assert isinstance(data, list), f"{where}: not a list"
        for i, item in enumerate(data):
            check_model(item, type_name[5:-1], f"{where}[{i}]")
        return
    if type_name.startswith(("dict(", "Dict[")):
        assert isinstance(data, dict), f"{where}: not a mapping"
        inner = type_name[5:-1].split(", ", 1)[1]
        for k, v in data.items():
            check_model(v, inner, f"{where}.{k}")
        return
    if type_name in PRIMITIVES:
        assert isinstance(data, PRIMITIVES[type_name]), f"{where}: {data!r} is no {type_name}"
        return
    cls = getattr(k8s_client().models, type_name)
    assert isinstance(data, dict), f"{where}: not a mapping for {type_name}"
    by_json = {json: attr for attr, json in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(by_json))
    assert not unknown, f"{where}: {type_name} has no field {unknown}"
    for key, value in data.items():
        check_model(value, cls.openapi_types[by_json[key]], f"{where}.{key}")


def core_model_name(doc: dict[str, Any]) -> str | None:
    prefix = CORE_GROUPS.get(doc.get("apiVersion", ""))
    return None if prefix is None else prefix + doc["kind"]


@pytest.mark.parametrize("where,doc", MANIFESTS, ids=[w for w, _ in MANIFESTS])
def test_every_manifest_is_a_valid_object_of_its_api(where: str, doc: dict[str, Any]) -> None:
    name = core_model_name(doc)
    if name is None:
        schema = SCHEMA["kinds"].get(f"{doc['apiVersion']}/{doc['kind']}")
        assert schema is not None, f"{where}: {doc['apiVersion']} {doc['kind']} has no schema"
        jsonschema.validate(doc, {**schema, "$defs": SCHEMA["$defs"]})
        return
    check_model(doc, name, where)
    # the client's own constructors check required fields (client-side validation)
    obj = k8s_client().ApiClient()._ApiClient__deserialize(doc, name)
    assert obj.metadata.name == doc["metadata"]["name"]


def test_the_checks_refuse_what_a_cluster_would() -> None:
    """The validators are not vacuous: a misspelt field, a missing required one and a bad
    InferencePool are refused."""
    deployment = next(d for _, d in MANIFESTS if d["kind"] == "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(AssertionError, match="livenesProbe"):
        check_model(bad, "V1Deployment", "bad")
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    del bad["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):
        k8s_client().ApiClient()._ApiClient__deserialize(bad, "V1Deployment")
    pool = next(d for _, d in MANIFESTS if d["kind"] == "InferencePool")
    schema = {**SCHEMA["kinds"]["inference.networking.k8s.io/v1/InferencePool"],
              "$defs": SCHEMA["$defs"]}
    for mutate in (lambda p: p["spec"].pop("endpointPickerRef"),
                   lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Open"),
                   lambda p: p["spec"].update(targetPorts=[{"number": 8000}] * 9),
                   lambda p: p["spec"].update(extensionRef={"name": "x"})):
        bad = yaml.safe_load(yaml.safe_dump(pool))
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_each_kustomization_names_exactly_its_files() -> None:
    for kust in sorted(K8S.glob("*/kustomization.yaml")):
        listed = yaml.safe_load(kust.read_text())["resources"]
        files = {r for r in listed if not r.startswith("..")}
        assert files == {p.name for p in kust.parent.glob("*.yaml")} - {kust.name}, kust
        for r in listed:
            assert (kust.parent / r).exists(), f"{kust}: {r} does not exist"


def config_maps() -> list[tuple[str, str, str]]:
    return [(where, key, text) for where, doc in MANIFESTS if doc["kind"] == "ConfigMap"
            for key, text in doc["data"].items()]


@pytest.mark.parametrize("where,key,text", config_maps())
def test_each_config_map_holds_a_config_file_its_command_parses(
        where: str, key: str, text: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    command = COMMAND_OF[key]
    assert text.startswith(f"# kvloop {command} --config /etc/kvloop/{key}\n")
    path = tmp_path / key
    ca = yaml.safe_load(text).get("nats-tls-ca")
    if ca is not None:   # the CA the pod mounts (checked below), as a file here
        assert ca == f"{NATS_CA_DIR}/ca.crt"
        write_pki(tmp_path)
        text = text.replace(ca, str(tmp_path / "ca.pem"))
    path.write_text(text)
    parser = build_parser()
    args = parser.parse_args(_expand_config([command, "--config", str(path)], parser))
    assert args.command == command
    # the containers run that command on that file, mounted where the comment says
    runs = [c for _, d in MANIFESTS if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]
            if c.get("command", [""])[-1] == f"/etc/kvloop/{key}"]
    assert runs and all(c["command"] == ["kvloop", command, "--config", f"/etc/kvloop/{key}"]
                        for c in runs)
    if ca is not None:
        assert all({"name": "nats-ca", "mountPath": NATS_CA_DIR, "readOnly": True}
                   in c["volumeMounts"] for c in runs)
    if command == "router":   # the router's own checks (with the secret the pod gets)
        from kvloop.router.cli_args import router_config

        monkeypatch.setenv("KVLOOP_FLEET_SECRET", "s" * 40)
        monkeypatch.setenv("KVLOOP_NATS_USER", "kvloop-router")
        monkeypatch.setenv("KVLOOP_NATS_PASSWORD", "pw")
        cfg = router_config(args)
        assert cfg.fleet_secret is not None and cfg.bus is not None
        assert cfg.bus.plane.tls and cfg.bus.plane.user == "kvloop-router"
    else:
        from kvloop.events.cli_args import publisher_config_from_args
        from kvloop.server.cli_args import check_flags

        check_flags(args)
        events = publisher_config_from_args(args)
        assert events is not None and events.nats is not None and events.nats.tls


def test_the_pool_the_picker_and_the_workers_agree() -> None:
    """The InferencePool selects the worker pods on their port and names the picker's
    Service on its ext_proc port, which the picker's config listens on."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in MANIFESTS}
    pool = docs[("InferencePool", "kvloop")]["spec"]
    worker = docs[("Deployment", "kvloop-worker")]["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    ports = [p["containerPort"] for p in worker["spec"]["containers"][0]["ports"]]
    assert [p["number"] for p in pool["targetPorts"]] == ports
    epp = docs[("Service", pool["endpointPickerRef"]["name"])]["spec"]["ports"]
    picker_port = pool["endpointPickerRef"]["port"]["number"]
    assert picker_port in [p["port"] for p in epp]
    epp_yaml = yaml.safe_load(docs[("ConfigMap", "kvloop-epp-config")]["data"]["epp.yaml"])
    assert epp_yaml["ext-proc-port"] == picker_port
    route = docs[("HTTPRoute", "kvloop")]["spec"]["rules"][0]["backendRefs"][0]
    assert (route["group"], route["kind"], route["name"]) == (
        "inference.networking.k8s.io", "InferencePool", "kvloop")
    # the workers' preStop drains them: SIGTERM to `kvloop serve` with a shutdown timeout
    # shorter than the grace period
    pre_stop = worker["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert "kill -TERM 1" in pre_stop[-1]
    cfg = yaml.safe_load(docs[("ConfigMap", "kvloop-config")]["data"]["worker.yaml"])
    assert cfg["shutdown-timeout"] < worker["spec"]["terminationGracePeriodSeconds"]
    env = {e["name"]: e for e in worker["spec"]["containers"][0]["env"]}
    assert re.match(r"/run/kvloop/", env["KVLOOP_FLEET_SECRET_FILE"]["value"])


def test_nats_runs_the_recipes_config_with_tls_and_a_user_per_role() -> None:
    """The NATS server runs deploy/nats/nats-server.conf (its copy here is the same bytes)
    from the folder where the TLS Secret is mounted as nats-tls/, with both roles'
    passwords; each kvloop pod is its role's user, with that role's password, and mounts the
    CA from the same Secret."""
    conf = K8S.parent / "nats" / "nats-server.conf"
    assert (K8S / "base" / "nats-server.conf").read_bytes() == conf.read_bytes()
    users = dict(re.findall(r'user: "([\w-]+)", password: \$(\w+)', conf.read_text()))
    assert users == {"kvloop-worker": "KVLOOP_NATS_WORKER_PASSWORD",
                     "kvloop-router": "KVLOOP_NATS_ROUTER_PASSWORD"}
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in MANIFESTS}
    fleet = docs[("Secret", "kvloop-fleet")]["stringData"]
    tls = docs[("Secret", "kvloop-nats-tls")]
    assert tls["type"] == "kubernetes.io/tls" and set(tls["stringData"]) == {
        "tls.crt", "tls.key", "ca.crt"}
    nats = docs[("Deployment", "kvloop-nats")]["spec"]["template"]["spec"]
    (server,) = nats["containers"]
    assert server["args"] == ["-c", "/etc/nats/conf/nats-server.conf"]
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["tls"] == f"{server['workingDir']}/nats-tls"
    volumes = {v["name"]: v for v in nats["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kvloop-nats-tls"
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert {"name": volumes["conf"]["configMap"]["name"], "files": ["nats-server.conf"]} \
        in kustomization["configMapGenerator"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server["env"]}
    assert set(env) == set(users.values())
    assert all(ref["name"] == "kvloop-fleet" and ref["key"] in fleet for ref in env.values())
    for name in ("kvloop-worker", "kvloop-router", "kvloop-epp"):
        pod = docs[("Deployment", name)]["spec"]["template"]["spec"]
        role = "kvloop-worker" if name == "kvloop-worker" else "kvloop-router"
        pod_env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert pod_env["KVLOOP_NATS_USER"]["value"] == role
        assert pod_env["KVLOOP_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == env[users[role]]
        ca = next(v for v in pod["volumes"] if v["name"] == "nats-ca")["secret"]
        assert ca == {"secretName": "kvloop-nats-tls",
                      "items": [{"key": "ca.crt", "path": "ca.crt"}]}
