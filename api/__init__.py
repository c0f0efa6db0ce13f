"""The planner's REST service: solve posted activation graphs (`planner.graph/v1`) into plans.

`main.create_app` builds the FastAPI app. The modules below it keep to one job each: `settings`
(environment variables), `schemas` (the wire format), `jobs` (the job store) over `databases` (SQLite
or PostgreSQL), `worker` (the bounded pool that claims and solves jobs), `solve_process` (one killable
child process per solve) running `solve_targets`, `limits`, `metrics` and `errors` (cross-cutting HTTP
concerns), `deps` (dependency aliases) and `routers/` (one router per resource). `jobs`, `worker` and
the modules under them do not import FastAPI, so they can be tested and reused without a web stack.
Nothing here imports torch.

The folder `api/` installs as the package `planner_service` (pyproject.toml's package-dir): import
`planner_service.main`, never `api.main`. From the repository root (pytest's `pythonpath = ["."]`) the
folder would also import as `api`, a second copy of every module whose classes and dependency functions
are not the app's, so `app.dependency_overrides` would silently miss; the check below refuses that.
"""

if __name__ != "planner_service":
    raise ImportError(
        f"the service's folder api/ installs as the package planner_service; import planner_service "
        f"(e.g. `from planner_service.main import create_app`), not {__name__}"
    )
