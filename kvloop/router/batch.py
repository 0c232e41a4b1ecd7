"""The Batch API on the router (kvloop/batch): its routes in the router's table, its lines
sent through the router's own app in flow control's batch band (kvloop/router/flow.py),
each batch owner a fairness tenant of that band."""

from __future__ import annotations

from starlette.applications import Starlette

from kvloop.batch.config import BatchConfig
from kvloop.batch.inproc import InProcessSender
from kvloop.batch.routes import BatchService
from kvloop.router.flow import FAIRNESS_HEADER, OBJECTIVE_HEADER, FlowControl


def attach_batch(app: Starlette, flow: FlowControl, cfg: BatchConfig) -> BatchService:
    """A `BatchService` whose routes are in `app`'s table (start and stop it with `app`)."""
    sender = InProcessSender(app, lambda owner: {OBJECTIVE_HEADER: flow.batch_objective,
                                                 FAIRNESS_HEADER: owner})
    service = BatchService(cfg, sender)
    app.router.routes.extend(service.routes())
    return service
