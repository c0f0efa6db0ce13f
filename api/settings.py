"""Service settings, read from `PLANNER_*` environment variables (or given to `create_app` directly).

One class holds every limit the service enforces, so that the README, the OpenAPI description and
the code cannot disagree about them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]

MIB = 2**20


class Settings(BaseSettings):
    """Limits and locations of one service process; `PLANNER_TOKEN=...` sets `token`, and so on."""

    model_config = SettingsConfigDict(env_prefix="PLANNER_", use_attribute_docstrings=True)

    db_path: Path = Path("planner-jobs.sqlite3")
    """SQLite file holding jobs and results; created on first start."""
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
    """Times a job is started before a job interrupted by restarts is marked failed."""
    retry_after_s: int = Field(default=5, ge=1)
    """Retry-After sent with 503 when the queue is full."""
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    """How long shutdown waits for running solves; unfinished ones run again after the restart."""
