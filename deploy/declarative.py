"""Serve configs applied the way `serve deploy` applies them, without the Ray dashboard.

`serve deploy` sends a config to the dashboard, which hands it to the Serve controller
(`ServeControllerClient.deploy_apps`). The controller then owns the applications
declaratively: a later config that changes one application's args rebuilds that
application only, and an application left out is deleted. pdserve's tests and
`pdserve up` start Ray without the dashboard, so `pdserve deploy` joins the cluster as a
driver and makes the same controller call itself (as the dashboard's handler does),
after validating the pdserve applications' args with their builders' preflight.

An application `serve.run` deployed (imperatively: `pdserve up` with one model) cannot be
taken over by a config: a cluster that is to be redeployed serves through a config from
the start (`pdserve up` with several models does).
"""

from __future__ import annotations

from typing import Any

from pdserve.cluster.config import ClusterConfig, ConfigError

# The builders whose args are a ClusterConfig (deploy/app.py); checked before applying.
PDSERVE_BUILDERS = ("pdserve.deploy.app:app_builder", "pdserve.deploy.app:model_app_builder")


def validate(config: dict[str, Any]) -> Any:
    """The config as Serve's `ServeDeploySchema`, every pdserve application's args checked
    as its builder checks them (`ClusterConfig.preflight`, Redis not pinged).

    Raises:
        ConfigError: naming the application and the field at fault.
        pydantic.ValidationError: the config is not a Serve config.
    """
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        if app.import_path not in PDSERVE_BUILDERS:
            continue
        try:
            ClusterConfig.from_serve_args(app.args).preflight()
        except ConfigError as exc:
            raise ConfigError(exc.field, f"(application {app.name}) {exc}") from None
    return schema


def apply(config: dict[str, Any]) -> list[str]:
    """Validate `config` and hand it to the Serve controller of the Ray cluster this
    process is connected to (starting Serve there if it is not running), as the
    dashboard does for `serve deploy`; return the names of its applications.

    It returns once the controller took the config: the applications build and their
    replicas start (or are replaced) in the background.
    """
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = validate(config)
    client = serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=schema.grpc_options.model_dump(),
        global_logging_config=schema.logging_config,
    )
    # what the dashboard receives from `serve deploy`: the fields the file set
    client.deploy_apps(ServeDeploySchema.model_validate(schema.model_dump(exclude_unset=True)))
    return [app.name for app in schema.applications]


def current() -> dict[str, Any]:
    """The Serve config the controller of the connected cluster holds now (what `serve
    config` prints through the dashboard): its HTTP options and the applications that
    were deployed from a config, with their args (secrets included)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # raises when Serve does not run there
    assert client is not None
    details = client.get_serve_details()
    apps = [
        app["deployed_app_config"]
        for app in details.get("applications", {}).values()
        if app.get("deployed_app_config") is not None
    ]
    http = details.get("http_options") or {}
    return {
        "http_options": {"host": http.get("host"), "port": http.get("port")},
        "applications": apps,
    }
