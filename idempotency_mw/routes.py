"""The app's routes as clients address them: every endpoint with its full path template, and which one a request
is for.

The templates label requests (``Event.route``) by route, never by raw path: a label per resource id, or per path a
scanner invents, would grow without bound. And a request that no route takes (the router answers 404 or 405, or
redirects it to a path with or without its trailing slash) runs nothing, so the middleware lets the router answer
it untouched: nothing is claimed or compared for it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.routing import Mount, Route, WebSocketRoute, compile_path

UNMATCHED = "<unmatched>"  # a request no route of the app matches (404s, probes, scans), or an app without routes


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """One endpoint of the app as the client addresses it: full path template (mount and router prefixes
    included), methods, and the endpoint object that may carry an :func:`idempotent` declaration."""

    path: str
    methods: frozenset[str] | None  # None: any method (a plain ASGI endpoint)
    endpoint: Any

    def matches(self, method: str, path: str, regex: re.Pattern[str]) -> bool:
        return (self.methods is None or method in self.methods) and regex.fullmatch(path) is not None


def iter_routes(routes: Iterable[Any], prefix: str = "") -> Iterator[RouteEntry]:
    """Every endpoint below ``routes``, through Mounts and FastAPI's included routers."""
    for route, path in _route_paths(routes):
        if isinstance(route, Mount):
            yield from iter_routes(route.routes, prefix + route.path)
        elif getattr(route, "endpoint", None) is not None and path is not None:
            methods = getattr(route, "methods", None)
            yield RouteEntry(prefix + path, frozenset(methods) if methods else None, route.endpoint)


def iter_opaque(routes: Iterable[Any], prefix: str = "") -> Iterator[str]:
    """The path templates under which the app routes requests by rules this module cannot read (a mounted app without
    a route table, a Host route, a route class of the app's own): ``prefix + "/{path:path}"``-style prefixes."""
    for route, path in _route_paths(routes):
        if isinstance(route, Mount):
            if route.routes:
                yield from iter_opaque(route.routes, prefix + route.path)
            else:
                yield prefix + route.path
        elif not isinstance(route, Route | WebSocketRoute) and (
            getattr(route, "endpoint", None) is None or path is None
        ):
            yield prefix


def _route_paths(routes: Iterable[Any]) -> Iterator[tuple[Any, str | None]]:
    routes = list(routes)
    try:  # FastAPI >= 0.160 keeps included routers as branches; this yields their routes with full paths
        from fastapi.routing import iter_route_contexts
    except ImportError:  # Starlette alone, or an older FastAPI whose included routes are flat
        yield from ((route, getattr(route, "path_format", None)) for route in routes)
        return
    for context in iter_route_contexts(routes):
        yield context.original_route, context.path_format


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """Which route a request is for: its template (to label it), and whether a route takes it: False when the
    router answers it without running anything (404, 405, a trailing-slash redirect), None when that cannot be
    told (an app without a route table, or a path under a mounted app whose routes are not readable)."""

    template: str
    routed: bool | None


class RouteTemplates:
    """The route templates of one app, to name the route a request is for and tell whether one takes it.

    Matching is cached by method and path, in a bounded cache: a scan of random paths cannot grow memory.
    """

    def __init__(self, app: Any) -> None:
        routes = getattr(app, "routes", None)
        self.routes: list[tuple[re.Pattern[str], str, frozenset[str] | None]] = [
            (compile_path(entry.path)[0], entry.path, entry.methods) for entry in iter_routes(routes or ())
        ]
        self.opaque = [re.compile(re.escape(prefix) + "(/.*)?") for prefix in iter_opaque(routes or ())]
        self.readable = routes is not None
        self.match = functools.lru_cache(maxsize=4096)(self._match)

    def _match(self, method: str, path: str) -> RouteMatch:
        """The first route whose path and method match, as the router picks it; else the first whose path does."""
        partial = None
        for regex, template, methods in self.routes:
            if regex.fullmatch(path):
                if methods is None or method in methods:
                    return RouteMatch(template, True)
                partial = partial or template
        unknown = not self.readable or any(prefix.fullmatch(path) for prefix in self.opaque)
        return RouteMatch(partial or UNMATCHED, None if unknown else False)
