"""Handles to the Serve application's deployments, for `app.rollout.client.RolloutClient` and `publish_lora`."""

from __future__ import annotations

from deployments.builders import APP_NAME


def handles(app_name: str = APP_NAME):
    """(Rollout, Reward, Adapters) DeploymentHandles of a running application."""
    from ray import serve

    return tuple(serve.get_deployment_handle(name, app_name) for name in ("Rollout", "Reward", "Adapters"))
