"""Handles to the Serve application's deployments, for `app.rollout.client.RolloutClient` and `publish_lora`."""

from __future__ import annotations

from deployments.builders import APP_NAME


def handles(app_name: str = APP_NAME):
    """(Rollout, Reward) DeploymentHandles of a running application."""
    from ray import serve

    return (serve.get_deployment_handle("Rollout", app_name), serve.get_deployment_handle("Reward", app_name))
