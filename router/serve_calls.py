"""Every call the router makes on a worker pool is a Serve request of its own.

A Ray Serve handle call made while a replica serves a request takes that request's
context: its internal request id and, in an ingress like the router, the rule that
cancelling the request cancels its calls. Both are wrong for the router's calls:

- Serve's request router (2.60) indexes the calls that wait for a replica by that id,
  and adds a second call under an id it holds already to its queue but not to its index.
  Whichever call a routing task picks a replica for, it hands the replica to the one the
  index names; the other never gets one, and its routing task loops with no backoff and
  no warning. One client request makes concurrent calls to a pool all the time: a
  resumed stream's `submit` while its old attempt's `abort` waits to be routed, a fetch's
  `push_prefix` beside a prefill call, a `/workers` call per worker. Seen as a call never
  answered: resumed streams with "no accepted from the decode worker within 120s" after
  a scale-down (tests/deploy/test_scale_down.py), pushes that never reached their holder.
- A token channel (router/channels.py) carries every request this router sends to one
  decode replica, for as long as that replica lives. Opened while serving one client's
  request, it would be cancelled when that client went away, failing the others.

So each call goes out under a request context of its own: the client request's id (for
logs), a fresh internal id, and no parent to be cancelled with. `detach(handle)` wraps a
pool's `DeploymentHandle` so that every `.remote(...)` of its methods does this. What
Serve's parent rule did for the calls that do work on a worker, the router does itself:
a stream's channel request is aborted (channels.py), and a prefill or a peer push is
awaited through `cancelling`, which cancels the call on its replica when the router
stops waiting (its client went away, a timeout).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from ray.serve import context as serve_context

H = TypeVar("H")
T = TypeVar("T")


async def cancelling(call: Awaitable[T]) -> T:
    """`await call` (a pool method's response); if this is cancelled, cancel the call on
    its replica too (best effort: `DeploymentResponse.cancel`)."""
    try:
        return await call
    except asyncio.CancelledError:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()
        raise


def detach(handle: H) -> H:
    """`handle`, each of whose method calls is a Serve request of its own (see above)."""
    if isinstance(handle, DetachedHandle):
        return handle
    return cast(H, DetachedHandle(handle))


def own_context() -> Any:
    """A request context for one call made while serving the current request."""
    current = serve_context._get_serve_request_context()
    return serve_context._RequestContext(
        route=current.route,
        request_id=current.request_id,
        _internal_request_id=uuid.uuid4().hex,
        app_name=current.app_name,
    )


class DetachedHandle:
    """A `DeploymentHandle` whose calls each run in `own_context()`."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def options(self, **kwargs: Any) -> DetachedHandle:
        return DetachedHandle(self._handle.options(**kwargs))

    def __getattr__(self, name: str) -> DetachedMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return DetachedMethod(getattr(self._handle, name))


class DetachedMethod:
    """`handle.method` of a `DetachedHandle`."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def options(self, **kwargs: Any) -> DetachedMethod:
        return DetachedMethod(self._method.options(**kwargs))

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        # The handle reads the context var while `.remote` runs (its request metadata):
        # set for just that long, in this task's context only.
        token = serve_context._serve_request_context.set(own_context())
        try:
            return self._method.remote(*args, **kwargs)
        finally:
            serve_context._serve_request_context.reset(token)
