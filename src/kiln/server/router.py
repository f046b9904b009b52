"""The version that serves each request, and what follows its answer: A/B weights and sticky keys choose the version
of a request that names none, each answer counts for its version, and a shadow version may get a mirrored copy.

routing.py holds each model's weights, counts and shadow (docs/ab-testing.md); this is the server's side of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kiln.errors import InvalidArgumentError, KilnError, ModelNotReadyError
from kiln.server.catalog import ModelCatalog
from kiln.server.registry import ModelRecord, ModelState, VersionRecord
from kiln.server.routing import (
    DEFAULT_KEY,
    ModelRouting,
    RoutingStatus,
    RoutingTable,
    check_weight,
    check_weights,
    parse_fraction,
    parse_version,
)
from kiln.server.scheduler import DynamicBatcher, Scheduler
from kiln.server.shadow import ShadowStats, mirror_request, uses_shared_memory
from kiln.server.validate import validate_request
from kiln.v2.types import InferRequest, InferResponse

_ROUTE_ATTEMPTS = 3


class Router:
    """The server's A/B routing table over the catalog's models."""

    def __init__(self, catalog: ModelCatalog) -> None:
        self._catalog = catalog
        self._table = RoutingTable()

    # -- requests --------------------------------------------------------------------------------------------

    def admit(self, request: InferRequest) -> tuple[Scheduler, int]:
        """The scheduler of the version that serves ``request`` (the one it names, else the routed one) and the
        request's batch size, once the request is checked against that version's spec."""
        found = self.route(request) if not request.model_version else \
            self._catalog.resolve(request.model_name, request.model_version)
        assert found.loaded is not None and found.scheduler is not None
        return found.scheduler, validate_request(found.loaded.spec, request)

    def joined_rows(self, request: InferRequest) -> int:
        """The most rows a request joined from several clients' requests (kiln.v2.joined) may have to run as one:
        the max_batch_size of the version that serves it, when that version batches dynamically and its model
        neither spreads requests over versions by weights nor mirrors them (each client's request must then be
        routed on its own); 0 when members must run one by one."""
        record = self._catalog.models.get(request.model_name)
        if record is None or record.spec is None:
            return 0
        try:
            if self._table.model(record.spec).splits_traffic:
                return 0
            found = self._catalog.resolve(request.model_name, request.model_version)
        except KilnError:
            return 0
        if not isinstance(found.scheduler, DynamicBatcher) or found.loaded is None:
            return 0
        return found.loaded.spec.max_batch_size

    def route(self, request: InferRequest) -> VersionRecord:
        """The version a request that names none goes to: by the model's weights, else the newest ready one."""
        record = self._catalog.record(request.model_name)
        chosen = None
        # A version swap may retire the chosen version between reading the ready list and taking the version:
        # read again, so a request during the swap goes to the version that replaced it.
        for _ in range(_ROUTE_ATTEMPTS):
            if record.spec is None:
                break
            ready = record.ready_versions()
            chosen = self._routing_of(record).choose(ready, request.parameters)
            if chosen is None and ready:
                chosen = ready[-1]
            if chosen is None:
                break
            found = record.versions.get(chosen)
            if found is not None and found.state is ModelState.READY:
                return found
        return self._catalog.resolve(request.model_name, "" if chosen is None else str(chosen))

    def after_answer(self, request: InferRequest, response: InferResponse, started_ns: int, sync: bool) -> None:
        """Count a successful answer for the routing status, then mirror the request to the shadow version if the
        model has one (the mirror runs later, on the event loop or, for a blocking caller, on the shadow thread
        pool, and never touches ``response``)."""
        record = self._catalog.models.get(request.model_name)
        if record is None or record.spec is None or not response.model_version.isdigit():
            return
        try:
            routing = self._table.model(record.spec)
        except KilnError:
            return  # bad kiln.* parameters: routed requests report it; explicit versions still serve
        served = int(response.model_version)
        routing.observe(served, not request.model_version, time.monotonic_ns() - started_ns, record.versions,
                        request.members)
        shadow = routing.shadow
        if shadow is None or shadow.version == served or uses_shared_memory(request) or not shadow.sample():
            return
        mirror = mirror_request(request, shadow.version)
        try:
            target = self._catalog.resolve(request.model_name, str(shadow.version))
            assert target.loaded is not None and target.scheduler is not None
            batch_size = validate_request(target.loaded.spec, mirror)
        except KilnError:
            shadow.skip()
            return
        scheduler, primary = target.scheduler, list(response.outputs)
        if sync:
            shadow.start_sync(lambda: scheduler.submit_sync(mirror, batch_size), primary)
        else:
            shadow.start(lambda: scheduler.submit(mirror, batch_size), primary)

    # -- settings and status ---------------------------------------------------------------------------------

    def status(self, name: str) -> RoutingStatus:
        record = self._catalog.record(name)
        return self._routing_of(record).status(record.ready_versions())

    def update(self, name: str, weights: Mapping[str, float] | Mapping[int, float] | None,
               shadow_version: str | int | None, shadow_fraction: float | None) -> RoutingStatus:
        """Check and apply new settings (see :meth:`kiln.server.server.Server.set_routing`)."""
        record = self._catalog.record(name)
        routing = self._routing_of(record)
        checked: dict[int, float] | None = None
        if weights is not None:
            checked = {}
            for given, weight in weights.items():
                version = parse_version(name, "routing weights", given)
                checked[version] = check_weight(name, "routing weights", version, weight)
            check_weights(name, "routing weights", checked)
        shadow = None if shadow_version is None else parse_version(name, "shadow version", shadow_version)
        fraction = None if shadow_fraction is None else parse_fraction(name, "shadow fraction", shadow_fraction)
        if record.spec is not None and record.spec.config.HasField("sequence_batching"):
            raise InvalidArgumentError(f"model '{name}': A/B routing and shadow traffic need a stateless model; "
                                       f"this one uses sequence_batching")
        routing.update(checked, shadow, fraction)
        return routing.status(record.ready_versions())

    def shadow_statistics(self) -> list[tuple[str, ShadowStats]]:
        return self._table.shadows()

    def key_parameter(self, name: str) -> str:
        record = self._catalog.models.get(name)
        try:
            return self._routing_of(record).key_parameter if record is not None else DEFAULT_KEY
        except KilnError:
            return DEFAULT_KEY

    def _routing_of(self, record: ModelRecord) -> ModelRouting:
        if record.spec is None:
            raise ModelNotReadyError(f"model '{record.name}' is not available: {record.reason}")
        return self._table.model(record.spec)
