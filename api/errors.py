"""Exception handlers: every error leaves the service as an `ErrorResponse` with the field it concerns.

- `PlannerError` -> 422, in one handler: an infeasible budget carries `min_peak_bytes`, `budget_bytes`
  and `breakdown`; an invalid graph lists one entry per offending field under `body.graph`;
  a job that failed for a reason that would repeat, or that ran past the time limit, is answered the
  same way. A job that was cancelled is 409. A job that failed because of a bug in the planner, or whose
  solver process died on every attempt, is 500, with the message, since resending cannot help.
- Request validation (pydantic) -> 422 with FastAPI's `loc` of each field (the input is not echoed).
- `QueueFull` -> 503 with `Retry-After`.
- Other HTTP errors (401, 404, 405, ...) keep their status and headers, in the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from planner.errors import InvalidGraph, PlannerError

from .jobs import JobError
from .schemas import ErrorItem, ErrorResponse
from .worker import JobFailed, QueueFull

__all__ = ["install_error_handlers"]


def _answer(status_code: int, body: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status_code, content=jsonable_encoder(body, exclude_none=True), headers=headers
    )


def _error_items(error: PlannerError, record: JobError) -> list[ErrorItem]:
    if isinstance(error, InvalidGraph):
        return [
            ErrorItem(loc=["body", "graph", *problem.location], msg=problem.message, type="invalid_graph")
            for problem in error.problems
        ]
    where: list[str | int] = ["body", "budget_bytes"] if record.type == "infeasible_budget" else []
    return [ErrorItem(loc=where, msg=record.message, type=record.type)]


async def planner_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, PlannerError), f"registered for PlannerError, got {type(error).__name__}"
    record = error.error if isinstance(error, JobFailed) else JobError.from_exception(error)
    body = ErrorResponse(
        detail=_error_items(error, record),
        budget_bytes=record.budget_bytes,
        min_peak_bytes=record.min_peak_bytes,
        breakdown=record.breakdown,
    )
    return _answer(record.http_status, body)


async def validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError), f"got {type(error).__name__}"
    return _answer(422, ErrorResponse(detail=_validation_items(error.errors())))


def _validation_items(errors: Sequence[Any]) -> list[ErrorItem]:
    return [
        ErrorItem(
            loc=[part for part in item.get("loc", ())],
            msg=str(item.get("msg", "")),
            type=str(item.get("type", "")),
        )
        for item in errors
    ]


async def queue_full(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, QueueFull), f"got {type(error).__name__}"
    body = ErrorResponse(detail=[ErrorItem(loc=[], msg=str(error), type="queue_full")])
    return _answer(503, body, headers={"Retry-After": str(error.retry_after_s)})


async def http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException), f"got {type(error).__name__}"
    body = ErrorResponse(detail=[ErrorItem(loc=[], msg=str(error.detail), type="http_error")])
    return _answer(error.status_code, body, headers=dict(error.headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(PlannerError, planner_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(QueueFull, queue_full)
    app.add_exception_handler(HTTPException, http_error)
