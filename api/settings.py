"""Service settings, read from `PLANNER_*` environment variables (or given to `create_app` directly).

One class holds every limit the service enforces, so that docs/service.md, the OpenAPI description and
the code cannot disagree about them.
"""

from __future__ import annotations

from os import PathLike
from typing import Any

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]

MIB = 2**20


class Settings(BaseSettings):
    """Limits and locations of one service process; `PLANNER_TOKEN=...` sets `token`, and so on."""

    model_config = SettingsConfigDict(
        env_prefix="PLANNER_", use_attribute_docstrings=True, populate_by_name=True
    )

    db: str = Field(
        default="planner-jobs.sqlite3",
        validation_alias=AliasChoices("planner_db", "planner_db_path"),
    )
    """Where jobs and results live: an SQLite file (created on first start), or a `postgresql://` URL
    that any number of replicas share. Set by PLANNER_DB (or PLANNER_DB_PATH, its older name)."""
    token: SecretStr | None = None
    """When set, /v1 requests need `Authorization: Bearer <token>`."""
    workers: int = Field(default=2, ge=0, le=64)
    """Solver threads. 0 accepts and stores jobs without solving them (they run after a restart)."""
    queue_size: int = Field(default=64, ge=1)
    """Jobs waiting for a worker before requests get 503 with Retry-After."""
    max_body_bytes: int = Field(default=32 * MIB, ge=1024)
    """Largest request body; larger ones get 413 before they are read."""
    max_nodes: int = Field(default=20_000, ge=1)
    """Largest graph the service solves, in nodes."""
    max_wait_s: float = Field(default=30.0, ge=0)
    """Longest a POST waits for its plan before answering 202 with a job to poll."""
    max_attempts: int = Field(default=2, ge=1)
    """Times a job is started before a job interrupted by restarts or solver crashes is marked failed."""
    solve_timeout_s: float = Field(default=600.0, gt=0)
    """Longest one solve (a plan job or a frontier) may run; past it the solve is killed and fails."""
    lease_s: float = Field(default=30.0, gt=0)
    """A running job's lease, renewed while it is solved; a replica that stops renewing it (it died)
    loses the job to another replica this long after its last renewal."""
    retry_after_s: int = Field(default=5, ge=1)
    """Retry-After sent with 503 when the queue is full."""
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    """How long shutdown waits for running solves; unfinished ones run again after the restart."""

    @field_validator("db", mode="before")
    @classmethod
    def _path_to_text(cls, value: Any) -> Any:
        """A `pathlib.Path` is accepted as the SQLite file it names."""
        return str(value) if isinstance(value, PathLike) else value
