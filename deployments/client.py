"""Handles to the Serve application's deployments, for `app.rollout.client.RolloutClient` and `publish_lora`, and
what a job needs to know of the application: whether one of the same sections runs (`running_fingerprint`), and
whether the one it starts ever serves (`ServingWatch`)."""

from __future__ import annotations

import threading

from deployments.builders import APP_NAME


def handles(app_name: str = APP_NAME):
    """(Rollout, Reward, Adapters) DeploymentHandles of a running application."""
    from ray import serve

    return tuple(serve.get_deployment_handle(name, app_name) for name in ("Rollout", "Reward", "Adapters"))


def running_fingerprint(app_name: str) -> str | None:
    """The fingerprint of the application `app_name` if it is up (running, or replacing a replica that died),
    else None."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    app = serve.status().applications.get(app_name)
    up = (ApplicationStatus.RUNNING, ApplicationStatus.UNHEALTHY, ApplicationStatus.DEPLOYING)
    if app is None or app.status not in up:
        return None
    try:
        return serve.get_deployment_handle("Adapters", app_name).fingerprint.remote().result(timeout_s=30)
    except Exception:  # another application of that name (no adapter store, or one without a fingerprint)
        return None


class ServingWatch:
    """Watches, in a thread, the Serve application that the trainer starts beside: once it runs, the watch ends;
    should it fail to deploy (a replica whose engine cannot start, every retry), `on_failure(message)` is called
    once and `failure` keeps the message. The job starts its training workers while the replicas load (the two
    loads overlap instead of adding up) and aborts the trainer through `on_failure`."""

    def __init__(self, app_name: str, on_failure, poll_s: float = 1.0):
        self.app_name, self.on_failure, self.poll_s = app_name, on_failure, poll_s
        self.failure: str | None = None
        self.running = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"serving-watch-{app_name}", daemon=True)

    def start(self) -> ServingWatch:
        self._thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        """True once the watch has ended (the application runs, or failed), False after `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self.wait(10 * self.poll_s)

    def _watch(self) -> None:
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        while not self._stop.is_set():
            try:
                app = serve.status().applications.get(self.app_name)
            except Exception:  # the controller busy or restarting: ask again
                app = None
            if app is not None and app.status == ApplicationStatus.RUNNING:
                self.running = True
                return
            if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
                self.failure = deploy_failure(app)
                self.on_failure(self.failure)
                return
            self._stop.wait(self.poll_s)


def deploy_failure(app) -> str:
    """What failed, in a line per failing deployment: its name and the last line of its error (the exception; the
    replica's whole traceback is in its log)."""
    lines = []
    for name, deployment in app.deployments.items():
        message = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        if deployment.status not in ("HEALTHY", "UPSCALING", "DOWNSCALING") and message:
            lines.append(f"{name}: {message[-1]}")
    return "; ".join(lines) or app.message.strip() or "no message from Serve"
