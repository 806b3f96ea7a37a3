"""docker/ and docker/k8s/: files parse, and every command they run exists and takes a valid config.

No Docker engine or cluster runs here, so this checks what can go stale without one: the
Dockerfiles' instructions and COPY sources, the `dapo` subcommands the images start, and the
Hydra overrides passed in compose and Kubernetes args (composed with dapo.config.load_config).
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from dapo.cli import SERVICES
from dapo.config import load_config, public_bind_error

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
PLACEHOLDER = re.compile(r"\$\{(\w+)[^}]*\}|\$\((\w+)\)")
SAMPLE_ENV = {"DAPO_TOKEN": "secret", "MODEL": "/models/m", "MODELS_DIR": "./models"}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def config_args(args: list[str]) -> list[str]:
    """Hydra overrides of a container's args, with env placeholders filled in, flags dropped."""
    filled = [PLACEHOLDER.sub(lambda m: SAMPLE_ENV[m.group(1) or m.group(2)], a) for a in args]
    return [a for a in filled if not a.startswith("--")]


@pytest.mark.parametrize("name", ["actor.Dockerfile", "learner.Dockerfile"])
def test_dockerfile_parses_and_starts_a_dapo_service(name):
    instructions = dockerfile_instructions(DOCKER / name)
    assert instructions[0][0] == "FROM"
    assert {k for k, _ in instructions} <= INSTRUCTIONS
    for keyword, rest in instructions:
        if keyword == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY source {src} missing"
    entry = json.loads(next(rest for k, rest in instructions if k == "ENTRYPOINT"))
    assert entry[0] == "dapo" and entry[1] in SERVICES
    assert entry[1] == name.split(".")[0]


def test_compose_services_reference_existing_images_and_valid_configs(tmp_path):
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"learner", "actor"}
    # The token is a compose secret read from its file, never an argument (readable in /proc/PID/cmdline).
    assert compose["secrets"]["dapo_token"]["file"].startswith("${DAPO_TOKEN_FILE:?")
    token = tmp_path / "token"
    token.write_text("compose-secret\n")
    token.chmod(0o600)
    for name, svc in services.items():
        dockerfile = (DOCKER / svc["build"]["context"]).resolve() / svc["build"]["dockerfile"]
        assert dockerfile.exists(), dockerfile
        assert svc["secrets"] == ["dapo_token"] and not any("auth_token=" in a for a in svc["command"])
        args = [a.replace("/run/secrets/dapo_token", str(token)) for a in config_args(svc["command"])]
        assert "transport.auth_token_file=" + str(token) in args
        cfg = load_config(args)
        assert cfg.transport.auth_token == "compose-secret" and public_bind_error(cfg.transport) is None
    # `--scale actor=N` needs the actor not to pin a container name or host port.
    assert "container_name" not in services["actor"] and "ports" not in services["actor"]
    assert any(a.startswith("--learner=learner:") for a in services["actor"]["command"])


def test_k8s_manifests_parse_and_run_valid_configs(monkeypatch):
    monkeypatch.setenv("DAPO_TOKEN", "k8s-secret")
    docs = {}
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    learner = docs[("StatefulSet", "dapo-learner")]
    actor = docs[("Deployment", "dapo-actor")]
    assert ("Service", "dapo-learner") in docs
    for workload, image in ((learner, "dapo-learner"), (actor, "dapo-actor")):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert container["image"].split(":")[0] == image
        # The token comes from a Secret in the environment, never an argument.
        assert container["env"] == [{"name": "DAPO_TOKEN", "valueFrom": {"secretKeyRef": {"name": "dapo-token",
                                                                                          "key": "token"}}}]
        assert not any("auth_token" in a or "DAPO_TOKEN" in a for a in container["args"])
        cfg = load_config(config_args(container["args"]))
        assert cfg.model.path.startswith("/models/")
        assert cfg.transport.auth_token == "k8s-secret" and public_bind_error(cfg.transport) is None
    actor_args = actor["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--learner=dapo-learner-0.dapo-learner:50051" in actor_args
    assert learner["spec"]["selector"]["matchLabels"] == learner["spec"]["template"]["metadata"]["labels"]


def test_placeholder_filling_is_strict():
    with pytest.raises(KeyError):
        config_args(["model.path=${NOT_DEFINED}"])
