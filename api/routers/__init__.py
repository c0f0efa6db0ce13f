"""One router per resource: plans (jobs), pareto (frontiers), health (liveness, readiness), metrics.

`error_responses` documents the error answers a route can give, so that the OpenAPI document (and the
schemathesis tests generated from it) know every status code and its body.
"""

from __future__ import annotations

from typing import Any

from ..schemas import ErrorResponse

__all__ = ["error_responses"]

_DESCRIPTIONS = {
    401: "PLANNER_TOKEN is set and the request has no matching `Authorization: Bearer` token",
    404: "No such job",
    409: "The job was cancelled (POST), or had already finished (DELETE)",
    413: "The body is larger than PLANNER_MAX_BODY_BYTES",
    422: "The body does not match the schema, the graph is not valid (each entry names the field), "
    "no plan fits the budget (min_peak_bytes says what would), or the solve ran past "
    "PLANNER_SOLVE_TIMEOUT_S",
    500: "The solver failed: a bug in the planner, or its process died on every attempt; the message "
    "says which",
    503: "The solver queue is full; retry after Retry-After seconds",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    503: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait"}},
}


def error_responses(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the given error status codes."""
    return {
        code: {
            "model": ErrorResponse,
            "description": _DESCRIPTIONS[code],
            **({"headers": _HEADERS[code]} if code in _HEADERS else {}),
        }
        for code in status_codes
    }
