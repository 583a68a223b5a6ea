"""Setting a pool's replica count from outside Serve's autoscaler.

Serve's external scaling API (`ServeController.update_deployment_replicas`, what its REST
endpoint `.../deployments/{name}/scale` calls) takes a deployment's target replica count
when its application was deployed with `external_scaler_enabled` (pdserve's
`external_scaler`, implied by the planner). `pdserve scale` and the planner call it. A
scale-down then stops replicas as Serve always does, and they drain
(cluster/drain.py).
"""

from __future__ import annotations

from typing import Any

SCALE_TIMEOUT_S = 30.0


def _controller() -> Any:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def _call(app_name: str, deployment: str, num_replicas: int) -> Any:
    from ray.serve._private.common import DeploymentID

    if num_replicas < 0:
        raise ValueError(f"a replica count is >= 0, got {num_replicas}")
    target = DeploymentID(name=deployment, app_name=app_name)
    return _controller().update_deployment_replicas.remote(target, num_replicas)


def set_replicas(app_name: str, deployment: str, num_replicas: int) -> None:
    """Set `deployment` of application `app_name` to `num_replicas` (blocking; a Ray
    driver or actor). Raises Serve's ExternalScalerDisabledError when the application
    was not deployed with the external scaler, ValueError for an unknown application."""
    import ray

    ray.get(_call(app_name, deployment, num_replicas), timeout=SCALE_TIMEOUT_S)


async def set_replicas_async(app_name: str, deployment: str, num_replicas: int) -> None:
    """`set_replicas` from an event loop (the planner, in a router replica)."""
    import asyncio

    await asyncio.wait_for(_call(app_name, deployment, num_replicas), SCALE_TIMEOUT_S)
