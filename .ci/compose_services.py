"""Turn compose.yaml's services into `podman run` arguments, one per line, for .ci/compose-smoke.sh.

Where no compose engine runs, CI starts the file's services by hand; reading them from the file (rather
than repeating them in the script) is what makes that a check of the file. Covers what compose.yaml
uses: image, environment, volumes, ports (published on 127.0.0.1, host ports shifted by
$COMPOSE_PORT_OFFSET so that CI does not collide with services of its own), depends_on and a CMD
healthcheck.

    python .ci/compose_services.py compose.yaml order              services, dependencies first
    python .ci/compose_services.py compose.yaml run SERVICE        its `podman run` options and image
    python .ci/compose_services.py compose.yaml health SERVICE     its healthcheck command
    python .ci/compose_services.py compose.yaml volumes            named volumes
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml


def start_order(services: dict[str, Any]) -> list[str]:
    """Services with each one's `depends_on` before it."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name not in ordered:
            for dependency in services[name].get("depends_on", {}):
                visit(dependency)
            ordered.append(name)

    for name in services:
        visit(name)
    return ordered


def run_arguments(service: dict[str, Any]) -> list[str]:
    arguments = []
    for key, value in service.get("environment", {}).items():
        arguments += ["-e", f"{key}={value}"]
    for volume in service.get("volumes", []):
        arguments += ["-v", volume]
    offset = int(os.environ.get("COMPOSE_PORT_OFFSET", "0"))
    for port in service.get("ports", []):
        host, container = str(port).split(":")
        arguments += ["-p", f"127.0.0.1:{int(host) + offset}:{container}"]
    return [*arguments, service["image"]]


def health_command(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if test[0] != "CMD":
        raise SystemExit(f"only CMD healthchecks are handled here, not {test[0]}")
    return list(test[1:])


def main() -> None:
    compose = yaml.safe_load(Path(sys.argv[1]).read_text())
    services = compose["services"]
    command = sys.argv[2]
    if command == "order":
        lines = start_order(services)
    elif command == "run":
        lines = run_arguments(services[sys.argv[3]])
    elif command == "health":
        lines = health_command(services[sys.argv[3]])
    elif command == "volumes":
        lines = list(compose.get("volumes", {}))
    else:
        raise SystemExit(f"unknown command {command!r}; see the module docstring")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
