"""A throwaway PostgreSQL server for the tests: Debian's `postgresql` binaries on a temporary directory.

`initdb` makes a cluster in a fresh directory, `pg_ctl` starts it on a free loopback port with its unix
socket in that directory, and the context manager stops it (`-m immediate`) and removes the directory.
Durability settings are off (fsync, synchronous_commit): the data dies with the test session anyway.
PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user that Debian's
package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.api.service_helpers import free_port

SERVER_USER = "postgres"
INSTALL_HINT = "apt-get install postgresql (Debian's server binaries: initdb, pg_ctl, postgres)"


def find_binaries() -> Path | None:
    """The directory holding initdb and pg_ctl: on PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    on_path = shutil.which("initdb")
    if on_path is not None:
        return Path(on_path).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda path: path.split("/")[4])
    return Path(candidates[-1]).parent if candidates else None


def why_unavailable() -> str | None:
    """Why no server can be started here (None when one can)."""
    if find_binaries() is None:
        return f"PostgreSQL's server binaries are not installed; {INSTALL_HINT}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return (
                f"running as root and there is no {SERVER_USER!r} user to run PostgreSQL as; {INSTALL_HINT}"
            )
    return None


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", SERVER_USER, "--", *command] if os.geteuid() == 0 else command


@contextmanager
def running_postgres() -> Iterator[str]:
    """Start a server; yield the URL of its `postgres` database (user `planner`, no password)."""
    binaries = find_binaries()
    assert binaries is not None, f"no PostgreSQL binaries: {INSTALL_HINT}"
    directory = Path(tempfile.mkdtemp(prefix="planner-postgres-"))
    if os.geteuid() == 0:
        account = pwd.getpwnam(SERVER_USER)
        os.chown(directory, account.pw_uid, account.pw_gid)
    data = directory / "data"
    port = free_port()
    run = _as_server_user
    subprocess.run(
        run([str(binaries / "initdb"), "-D", str(data), "-U", "planner", "--auth=trust", "--no-sync"]),
        check=True,
        capture_output=True,
    )
    options = (
        f"-p {port} -k {directory} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off"
    )
    pg_ctl = str(binaries / "pg_ctl")
    log_file = directory / "server.log"
    try:
        subprocess.run(
            run([pg_ctl, "-D", str(data), "-l", str(log_file), "-o", options, "-w", "-t", "60", "start"]),
            check=True,
            capture_output=True,
        )
        yield f"postgresql://planner@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            run([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), check=False, capture_output=True
        )
        shutil.rmtree(directory, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """Create an empty database on the server; its URL."""
    import psycopg

    name = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + f"/{name}"
