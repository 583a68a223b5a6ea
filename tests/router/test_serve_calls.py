"""router/serve_calls.py: each call the router makes on a pool is a Serve request of its
own. The unit tests read the request context a handle sees while `.remote` runs; the
cluster test makes concurrent calls from inside one Serve request, as the router does,
through a real Ray Serve (2.60 loses some of them unless each has its own id)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve import context as serve_context

from pdserve.router.serve_calls import DetachedHandle, cancelling, detach
from tests.router.fakes import in_loop


class _Method:
    """A handle method that records the request context each call was made in."""

    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen

    def options(self, **kwargs: Any) -> _Method:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        self.seen.append(serve_context._get_serve_request_context())
        return args


class _Handle:
    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.options_given: list[dict[str, Any]] = []

    def options(self, **kwargs: Any) -> _Handle:
        self.options_given.append(kwargs)
        return self

    @property
    def submit(self) -> _Method:
        return _Method(self.seen)


def _in_request(request_id: str, internal_id: str) -> Any:
    return serve_context._serve_request_context.set(
        serve_context._RequestContext(
            route="/v1/completions",
            request_id=request_id,
            _internal_request_id=internal_id,
            app_name="pdserve",
            cancel_on_parent_request_cancel=True,
        )
    )


def test_each_call_gets_a_fresh_internal_id_and_keeps_the_client_request_id() -> None:
    handle = _Handle()
    token = _in_request("cmpl-1", "internal-parent")
    try:
        detached = detach(handle)
        assert detached.submit.remote(1, x=2) == (1,)  # the call and its result pass through
        detached.submit.remote()
        parent = serve_context._get_serve_request_context()
    finally:
        serve_context._serve_request_context.reset(token)
    first, second = handle.seen
    for seen in (first, second):
        assert seen.request_id == "cmpl-1"
        assert seen.route == "/v1/completions" and seen.app_name == "pdserve"
        assert seen._internal_request_id not in ("", "internal-parent")
        assert not seen.cancel_on_parent_request_cancel  # not cancelled with the client's
    assert first._internal_request_id != second._internal_request_id
    # the request's own context is back once `.remote` returned
    assert parent._internal_request_id == "internal-parent"


def test_options_stay_detached_and_detach_is_idempotent() -> None:
    handle = _Handle()
    detached = detach(handle)
    streaming = detached.options(stream=True)
    assert isinstance(streaming, DetachedHandle)
    assert handle.options_given == [{"stream": True}]
    assert detach(detached) is detached
    token = _in_request("cmpl-2", "internal-2")
    try:
        streaming.submit.options(stream=True).remote()
    finally:
        serve_context._serve_request_context.reset(token)
    assert handle.seen[0]._internal_request_id != "internal-2"
    with pytest.raises(AttributeError):
        detached._private  # noqa: B018 (private names are not methods of the pool)


class _Response:
    """A pool call's response: awaitable, cancellable on its replica."""

    def __init__(self) -> None:
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.cancelled_on_replica = False

    def __await__(self) -> Any:
        return self.done.__await__()

    def cancel(self) -> None:
        self.cancelled_on_replica = True


@in_loop
async def test_a_call_the_router_stops_waiting_for_is_cancelled_on_its_replica() -> None:
    answered, abandoned = _Response(), _Response()
    answered.done.set_result("report")
    assert await cancelling(answered) == "report"
    assert not answered.cancelled_on_replica
    # the router's wait ends (a client that went away, a timeout): the call is cancelled
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(cancelling(abandoned), 0.01)
    assert abandoned.cancelled_on_replica


@pytest.mark.cluster  # tests/conftest.py, 'test tiers'
def test_concurrent_calls_from_one_serve_request_are_all_answered() -> None:
    """An ingress replica makes 8 rounds of 6 concurrent calls to a pool routed by
    pdserve's request router while it serves one request: through detached handles every
    call is answered. Through the plain handle most are never routed (Ray Serve 2.60):
    if that part starts failing, Serve tells its calls apart itself and serve_calls.py
    can go."""
    import ray
    from ray import serve

    from pdserve.deploy.app import _TARGETED

    @serve.deployment(max_ongoing_requests=64, request_router_config=_TARGETED)
    class Echo:
        async def ping(self, i: int, target_replica: str | None = None) -> int:
            await asyncio.sleep(0)
            return i

    @serve.deployment
    class Caller:
        def __init__(self, echo: Any) -> None:
            self.echo = echo

        async def fanout(self, rounds: int, width: int, detached: bool, wait_s: float) -> int:
            echo = detach(self.echo) if detached else self.echo
            answered = 0
            for r in range(rounds):
                calls = [
                    asyncio.ensure_future(echo.ping.remote(r * width + i)) for i in range(width)
                ]
                done, pending = await asyncio.wait(calls, timeout=wait_s)
                for task in pending:
                    task.cancel()
                answered += sum(1 for t in done if t.exception() is None)
            return answered

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Caller.bind(Echo.bind()), name="serve-calls", route_prefix=None)
        rounds, width = 8, 6
        answered = handle.fanout.remote(rounds, width, True, 30.0).result(timeout_s=300)
        assert answered == rounds * width
        # the same calls in the request's own context: one per round is answered
        assert handle.fanout.remote(1, width, False, 5.0).result(timeout_s=60) < width
    finally:
        serve.shutdown()
        ray.shutdown()
