"""The container files stay true to the code: every ``honing`` command in deploy/compose.yaml
parses with honing's CLI and its config resolves and passes the run's rules, the URLs the
trainer is given name a compose service and the port it listens on, the health checks ask a
real route of the services, and the Containerfile installs what pyproject.toml defines.

Each check is a function returning the problems it finds, so the mutation tests below show
that each one can fail."""

import copy
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import yaml

from honing import cli
from honing.config import resolve_config
from honing.errors import UserError
from honing.pipeline.rules import check_config
from honing.services.app import create_app
from honing.services.options import check_ranges
from honing.services.rollout import rollout_app

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "deploy" / "compose.yaml"
CONTAINERFILE = ROOT / "Containerfile"
IMAGE_EXAMPLES = "/opt/honing/examples/"  # where the Containerfile copies examples/
HEALTHCHECK_IN_IMAGE = "/opt/honing/healthcheck.py"


def _load_healthcheck():
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "deploy/healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEALTHCHECK = _load_healthcheck()


def _with_defaults(value):
    """Compose's ``${NAME:-default}`` (and ``${NAME}``) replaced by its default, everywhere."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    if isinstance(value, list):
        return [_with_defaults(item) for item in value]
    if isinstance(value, dict):
        return {key: _with_defaults(item) for key, item in value.items()}
    return value


def _compose() -> dict:
    return _with_defaults(yaml.safe_load(COMPOSE.read_text()))


def _command(service: dict) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else [str(arg) for arg in command]


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def command_problems(compose: dict) -> list[str]:
    """Each service's command parses with ``honing``'s CLI; a serve command's numbers are in
    range; a train command's config resolves (with the service's environment) and passes the
    rules a run checks before it starts."""
    problems = []
    for name, service in compose["services"].items():
        args = _command(service)
        try:
            ns = cli._parser().parse_args(args)
        except SystemExit:
            problems.append(f"{name}: honing {' '.join(args)} does not parse")
            continue
        try:
            if ns.command == "serve":
                check_ranges(ns)
            elif ns.command == "train":
                path, overrides = cli._split_args(ns.args)
                if path and path.startswith(IMAGE_EXAMPLES):
                    path = str(ROOT / "examples" / path.removeprefix(IMAGE_EXAMPLES))
                check_config(resolve_config(path, overrides, environ=_environment(service)))
        except UserError as err:
            problems.append(f"{name}: {err}")
    return problems


def _listens_on(service: dict) -> tuple[str, str] | None:
    """(host, port) of a ``honing serve`` command, read as the image's health check reads it."""
    args = _command(service)
    if args[:1] != ["serve"]:
        return None
    return (
        HEALTHCHECK._option(args, "--host", "127.0.0.1"),
        HEALTHCHECK._option(args, "--port", HEALTHCHECK.DEFAULT_PORT),
    )


def _trainer_urls(service: dict) -> list[str]:
    """The service URLs a train command is given: reward.endpoint / VERIFIER_ENDPOINT and
    rollout.endpoints."""
    path, overrides = cli._split_args(cli._parser().parse_args(_command(service)).args)
    config = resolve_config(None, overrides, environ=_environment(service))
    joined = f"{config.reward.endpoint},{config.rollout.endpoints}"
    return [url.strip() for url in joined.split(",") if url.strip()]


def wiring_problems(compose: dict) -> list[str]:
    """Every URL a trainer is given names a compose service running ``honing serve`` on all
    interfaces at that port; the trainer waits for it to be healthy; it has a health check."""
    services = compose["services"]
    problems = []
    trainers = [name for name, s in services.items() if _command(s)[:1] == ["train"]]
    if not trainers:
        problems.append("no service runs honing train")
    for trainer in trainers:
        urls = _trainer_urls(services[trainer])
        if not urls:
            problems.append(f"{trainer}: given no verifier or rollout URL")
        depends = services[trainer].get("depends_on") or {}
        for url in urls:
            parts = urlsplit(url)
            target = services.get(parts.hostname)
            listens = _listens_on(target) if target else None
            if listens is None:
                problems.append(f"{trainer}: {url} names no honing serve service")
                continue
            host, port = listens
            if host != "0.0.0.0":
                problems.append(f"{parts.hostname}: --host {host} is not reachable from others")
            if str(parts.port or 80) != port:
                problems.append(f"{trainer}: {url}, but {parts.hostname} listens on {port}")
            if (depends.get(parts.hostname) or {}).get("condition") != "service_healthy":
                problems.append(f"{trainer}: no depends_on {parts.hostname}: service_healthy")
            if "healthcheck" not in target:
                problems.append(f"{parts.hostname}: no healthcheck")
    return problems


def healthcheck_problems(compose: dict, containerfile: str) -> list[str]:
    """The compose health checks and the image's HEALTHCHECK run the image's check script,
    which the Containerfile copies there; its path is a GET route of every service; its
    default port is ``honing serve``'s."""
    problems = []
    for name, service in compose["services"].items():
        test = (service.get("healthcheck") or {}).get("test")
        if test and HEALTHCHECK_IN_IMAGE not in test:
            problems.append(f"{name}: healthcheck {test} does not run {HEALTHCHECK_IN_IMAGE}")
    healthcheck = re.search(r"^HEALTHCHECK .*?CMD (\[.*?\])$", containerfile, re.M | re.S)
    if not healthcheck or HEALTHCHECK_IN_IMAGE not in healthcheck.group(1):
        problems.append(f"Containerfile: no HEALTHCHECK running {HEALTHCHECK_IN_IMAGE}")
    if not re.search(rf"^COPY deploy/healthcheck.py {HEALTHCHECK_IN_IMAGE}$", containerfile, re.M):
        problems.append("Containerfile: deploy/healthcheck.py is not copied to the image")
    apps = {
        "verifier": create_app(None, service="verifier"),
        "rollout": rollout_app(SimpleNamespace(), model_name="policy"),
    }
    for service, app in apps.items():
        gets = {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}
        if HEALTHCHECK.HEALTH_PATH not in gets:
            problems.append(f"{service}: no GET {HEALTHCHECK.HEALTH_PATH} route")
    for service in ("verifier", "rollout", "reward-model"):
        model = [] if service == "verifier" else ["--model", "m"]
        port = cli._parser().parse_args(["serve", service, *model]).port
        if str(port) != HEALTHCHECK.DEFAULT_PORT:
            problems.append(f"healthcheck's default port is not serve {service}'s ({port})")
    return problems


def _build_args(containerfile: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=?(.*)$", containerfile, re.M))


def containerfile_problems(containerfile: str, pyproject: dict) -> list[str]:
    """The image's extras exist (and leave out dev), its entry point is the ``honing``
    script, its examples are where the compose file and the docs look for them, and its
    default torch is the one ``make setup`` installs."""
    problems = []
    args = _build_args(containerfile)
    extras = set(args.get("EXTRAS", "").split(","))
    defined = set(pyproject["project"]["optional-dependencies"])
    if extras - defined:
        problems.append(f"EXTRAS {sorted(extras - defined)} are not in pyproject.toml")
    if "dev" in extras:
        problems.append("EXTRAS includes dev")
    if "honing" not in pyproject["project"]["scripts"]:
        problems.append("pyproject.toml has no honing script")
    if not re.search(r'^ENTRYPOINT \["honing"\]$', containerfile, re.M):
        problems.append('Containerfile: ENTRYPOINT is not ["honing"]')
    if not re.search(rf"^COPY examples {IMAGE_EXAMPLES.rstrip('/')}$", containerfile, re.M):
        problems.append(f"Containerfile: examples/ is not copied to {IMAGE_EXAMPLES}")
    makefile_torch = re.search(r"^TORCH \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    if not makefile_torch or args.get("TORCH") != makefile_torch.group(1):
        problems.append(f"Containerfile TORCH={args.get('TORCH')} is not the Makefile's")
    for source in re.findall(r"^COPY (.+) \S+$", containerfile, re.M):
        for path in source.split():
            if not (ROOT / path).exists():
                problems.append(f"Containerfile: COPY {path}: no such file")
    return problems


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_compose_commands_parse_and_their_configs_resolve():
    assert command_problems(_compose()) == []


def test_compose_services_reach_each_other():
    assert wiring_problems(_compose()) == []


def test_health_checks_ask_a_real_route():
    assert healthcheck_problems(_compose(), CONTAINERFILE.read_text()) == []


def test_containerfile_matches_pyproject():
    assert containerfile_problems(CONTAINERFILE.read_text(), _pyproject()) == []


def test_context_sends_what_the_containerfile_copies():
    """.dockerignore (read by docker and podman) admits every COPY source and nothing from
    the local state (.venv, runs, caches, .git)."""
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "the context is an allowlist"
    allowed = {rule[1:] for rule in rules if rule.startswith("!")}
    copied = re.findall(r"^COPY (.+) \S+$", CONTAINERFILE.read_text(), re.M)
    assert {path for source in copied for path in source.split()} <= allowed
    assert not allowed & {".venv", "runs", ".git", ".cache", "benchmarks", "tests"}


def _drop(command: list[str], prefix: str) -> None:
    command[:] = [arg for arg in command if not arg.startswith(prefix)]


def _mutated(edit):
    compose = copy.deepcopy(_compose())
    edit(compose)
    return compose


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c["services"]["rollout"]["command"].append("--prot"), "does not parse"),
        (lambda c: c["services"]["rollout"]["command"].extend(["--port", "70000"]), "--port"),
        (lambda c: c["services"]["trainer"]["command"].insert(2, "rollout.grup_size=4"), "grup"),
        (lambda c: c["services"]["trainer"]["command"].insert(2, "rollout.top_p=2"), "top_p"),
        (lambda c: c["services"]["trainer"]["command"].append("trainer.seed=1"), "not parse"),
        (lambda c: _drop(c["services"]["trainer"]["command"], "rollout.endpoints="), "endpoints"),
    ],
)
def test_command_check_catches(edit, expected):
    problems = command_problems(_mutated(edit))
    assert any(expected in problem for problem in problems), problems


def _set_port(compose: dict, service: str, port: str) -> None:
    command = compose["services"][service]["command"]
    command[command.index("--port") + 1] = port


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: _set_port(c, "verifier-2", "8081"), "verifier-2 listens on 8081"),
        (lambda c: _set_port(c, "rollout", "8001"), "rollout listens on 8001"),
        (
            lambda c: c["services"]["trainer"]["environment"].update(
                VERIFIER_ENDPOINT="http://verifier-3:8080"
            ),
            "names no honing serve service",
        ),
        (lambda c: c["services"]["trainer"]["depends_on"].pop("rollout"), "depends_on rollout"),
        (lambda c: c["services"]["verifier-1"].pop("healthcheck"), "verifier-1: no healthcheck"),
        (
            lambda c: c["services"]["verifier-1"].update(
                command=["serve", "verifier", "--port", "8080"]
            ),
            "--host 127.0.0.1",
        ),
    ],
)
def test_wiring_check_catches(edit, expected):
    problems = wiring_problems(_mutated(edit))
    assert any(expected in problem for problem in problems), problems


def test_healthcheck_check_catches(monkeypatch):
    containerfile = CONTAINERFILE.read_text()
    moved = containerfile.replace(f"healthcheck.py {HEALTHCHECK_IN_IMAGE}", "healthcheck.py /hc.py")
    assert any("not copied" in p for p in healthcheck_problems(_compose(), moved))
    monkeypatch.setattr(HEALTHCHECK, "HEALTH_PATH", "/healthz")
    problems = healthcheck_problems(_compose(), containerfile)
    assert "verifier: no GET /healthz route" in problems
    assert "rollout: no GET /healthz route" in problems


def test_containerfile_check_catches():
    containerfile = CONTAINERFILE.read_text()
    bad_extras = re.sub(r"^ARG EXTRAS=.*$", "ARG EXTRAS=ray,gpu,dev", containerfile, flags=re.M)
    problems = containerfile_problems(bad_extras, _pyproject())
    assert "EXTRAS ['gpu'] are not in pyproject.toml" in problems
    assert "EXTRAS includes dev" in problems
    entry = containerfile.replace('ENTRYPOINT ["honing"]', 'ENTRYPOINT ["python"]')
    assert 'Containerfile: ENTRYPOINT is not ["honing"]' in containerfile_problems(
        entry, _pyproject()
    )


def test_healthcheck_reads_the_serve_command():
    args = ["serve", "rollout", "--model", "m", "--host", "0.0.0.0", "--port=8001"]
    assert HEALTHCHECK._option(args, "--port", "8080") == "8001"
    assert HEALTHCHECK._option(args, "--host", "127.0.0.1") == "0.0.0.0"
    assert HEALTHCHECK._option(["serve", "verifier"], "--port", "8080") == "8080"
