"""Test harness: environment for offline, single-threaded CPU runs, the shared tiny checkpoint, and a guard that
fails the run when no test ran or when a test was skipped (a skip is never counted as a pass)."""

import asyncio
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CACHE = Path(os.environ.get("RAY_FLOWGRPO_TEST_CACHE", REPO_ROOT / ".cache" / "tests"))


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)  # 2-core CI machines: oversubscription makes tiny models 40x slower
    # pytest-xdist (3.6+) hands out the groups of `--dist loadgroup` largest first by their number of tests, which
    # left the one-test learning modules (minutes each) to the end, one worker running them while the other idled;
    # the groups go in the order pytest_collection_modifyitems gives them instead
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False


RAY_FIXTURES = {"ray_cluster", "job_cluster"}


def _uses_ray(item) -> bool:
    return bool(RAY_FIXTURES & set(getattr(item, "fixturenames", ()))) or any(
        item.get_closest_marker(m) for m in ("jobs", "ray"))


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_runtest_setup(item):
    """An xdist worker that runs an in-process test lowers its priority for good (nice 19): the Ray tests' clusters
    on the other worker need both cores at their start, and the in-process tests take what they leave. The worker
    that runs the Ray group starts with it (the first group) and so stays at its priority while it runs it."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not _uses_ray(item) and os.getpriority(os.PRIO_PROCESS, 0) < 19:
        os.setpriority(os.PRIO_PROCESS, 0, 19)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group markers into the test ids
def pytest_collection_modifyitems(config, items):
    """`jobs` tests run first: each starts its own Ray cluster, and the session's cluster and engines (started by
    later tests, kept to the end) would otherwise idle next to them on the same cores; then the other Ray tests,
    then the modules that hold slow tests, the quick ones last. GPU tests are deselected
    on machines without CUDA (reported as deselected, never as passed or skipped); on a machine with CUDA the
    engines' tests (`engine`) count as GPU tests too, so `-m gpu` runs them there on CUDA.

    Under pytest-xdist (`make test`: `-n 2 --dist loadgroup`) every test that starts or joins a Ray cluster goes to
    one worker, in this order (one cluster at a time, as in a run without workers), and the other tests go a module
    at a time (a module's fixtures built once): the in-process tests, one thread each, use the second core."""
    import torch

    slow_modules = {_module(item) for item in items if item.get_closest_marker("slow")}
    # stable: file order within each kind. The Ray group first (its job runs first of all), then the modules with
    # slow tests (learning runs, compilations: minutes each), the quick modules last, so that the workers end
    # together instead of one running a long module while the other idles
    items.sort(key=lambda item: (item.get_closest_marker("jobs") is None, not _uses_ray(item),
                                 _module(item) not in slow_modules))
    for item in items:
        item.add_marker(pytest.mark.xdist_group("ray" if _uses_ray(item) else _module(item)))
    if torch.cuda.is_available():
        for item in items:  # the engines' tests run on CUDA here: part of a GPU run (`-m gpu`)
            if item.get_closest_marker("engine"):
                item.add_marker(pytest.mark.gpu)
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller, once a worker has collected
def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup` every test id must carry its group (xdist appends `@group` on the worker); a pytest
    whose ids ignore that would run two Ray clusters side by side on two workers, silently: stop instead."""
    if node.config.getvalue("dist") == "loadgroup":
        lost = [nodeid for nodeid in ids if "@" not in nodeid.rsplit("]", 1)[-1]]
        if lost:
            pytest.exit(f"xdist's loadgroup lost the groups of {len(lost)} tests (e.g. {lost[0]}): pytest-xdist "
                        "cannot group tests on this pytest; install pytest<9.2 (pyproject.toml's bound)", returncode=4)


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0 or hasattr(session.config, "workerinput"):  # xdist: the controller counts
        return
    passed = len(reporter.stats.get("passed", []))
    skipped = len(reporter.stats.get("skipped", []))
    if passed == 0:
        reporter.write_line("ERROR: no test passed (none collected, or all deselected/skipped)", red=True)
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
    elif skipped:
        reporter.write_line(f"ERROR: {skipped} test(s) skipped; a skipped test is not a pass", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen-Image checkpoint, built once into the cache folder and reused across sessions."""
    from app.models.qwen_image.tiny import build_tiny_qwen_image

    return build_tiny_qwen_image(TINY_CACHE / "tiny-qwen-image", seed=0)


@pytest.fixture(scope="session")
def tiny_flux_dir() -> Path:
    """The tiny FLUX.1 checkpoint, built once into the cache folder and reused across sessions."""
    from app.models.flux.tiny import build_tiny_flux

    return build_tiny_flux(TINY_CACHE / "tiny-flux", seed=0)


@pytest.fixture(scope="session")
def tiny_z_image_dir() -> Path:
    """The tiny Z-Image checkpoint, built once into the cache folder and reused across sessions."""
    from app.models.z_image.tiny import build_tiny_z_image

    return build_tiny_z_image(TINY_CACHE / "tiny-z-image", seed=0)


@pytest.fixture(scope="session")
def tiny_wan_dir() -> Path:
    """The tiny Wan checkpoint, built once into the cache folder and reused across sessions."""
    from app.models.wan.tiny import build_tiny_wan

    return build_tiny_wan(TINY_CACHE / "tiny-wan", seed=0)


@pytest.fixture(scope="session")
def tiny_bagel_dir() -> Path:
    """The tiny BAGEL checkpoint, built once into the cache folder and reused across sessions."""
    from app.models.bagel.tiny import build_tiny_bagel

    return build_tiny_bagel(TINY_CACHE / "tiny-bagel", seed=0)


@pytest.fixture(scope="session")
def tiny_bagel_full_ae_dir() -> Path:
    """The tiny BAGEL with the real autoencoder (321 MB): the checkpoint vllm-omni's thinker stage can load."""
    from app.models.bagel.tiny import build_tiny_bagel_full_ae

    return build_tiny_bagel_full_ae(TINY_CACHE / "tiny-bagel-full-ae", seed=0)


@pytest.fixture(scope="session")
def tiny_clip_dir() -> Path:
    """The tiny CLIP reward model (PickScore's, CLIPScore's and the aesthetic score's architecture) and its aesthetic
    head, built once into the cache folder."""
    from app.rewards.tiny import build_tiny_clip

    return build_tiny_clip(TINY_CACHE / "tiny-clip", seed=0)


@pytest.fixture(scope="session")
def tiny_judge_dir() -> Path:
    """The tiny Qwen2.5-VL judge (model, processor, chat template), built once into the cache folder."""
    from app.rewards.tiny import build_tiny_judge

    return build_tiny_judge(TINY_CACHE / "tiny-judge", seed=0)


@pytest.fixture(scope="session")
def tiny_sd3_dir() -> Path:
    """The tiny SD3 checkpoint, built once into the cache folder and reused across sessions."""
    from app.models.sd3.tiny import build_tiny_sd3

    return build_tiny_sd3(TINY_CACHE / "tiny-sd3", seed=0)


@pytest.fixture(scope="module")
def nccl_group():
    """A process group of one rank on the GPU (NCCL), as a Ray Train worker has: FSDP2 wraps the model under it."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def aio():
    """Runs a coroutine on one event loop kept for the whole session (the engine's background tasks live there)."""
    with asyncio.Runner() as runner:
        yield runner.run


def _started(engine, aio):
    aio(engine.start())
    yield engine
    aio(engine.close())


class OneVllmEngine:
    """vllm-omni keeps its model-parallel state in module globals: one engine lives in a process at a time. A module
    asks for the engine of its model (`get`); the one alive for another model is closed first, so the modules that
    use them may run in any order."""

    def __init__(self, aio):
        self.aio, self.key, self.engine = aio, None, None

    def get(self, path, family: str = "qwen_image", **options):
        """options: the engine's other arguments (thinker_stage=True: another engine)."""
        from app.rollout.vllm_omni.engine import VllmOmniEngine

        key = (str(path), family, tuple(sorted(options.items())))
        if self.key != key:
            self.close()
            engine = VllmOmniEngine(path, family=family, **options)
            self.aio(engine.start())
            self.key, self.engine = key, engine
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            engine, self.key, self.engine = self.engine, None, None
            self.aio(engine.close())


@pytest.fixture(scope="session")
def vllm_engines(aio):
    registry = OneVllmEngine(aio)
    yield registry
    registry.close()


@pytest.fixture(scope="module")
def vllm_engine(vllm_engines, tiny_model_dir):
    """The real vllm-omni engine of the tiny Qwen-Image (CPU platform here), kept while no other model needs one."""
    return vllm_engines.get(tiny_model_dir)


@pytest.fixture(scope="session")
def diffusers_engine(tiny_model_dir, aio):
    from app.rollout.diffusers_engine import DiffusersEngine

    yield from _started(DiffusersEngine(tiny_model_dir), aio)


@pytest.fixture(scope="session")
def sd3_engine(tiny_sd3_dir, aio):
    """The tiny SD3 on plain diffusers (the parity oracle)."""
    from app.rollout.sd3_engine import SD3Engine

    yield from _started(SD3Engine(tiny_sd3_dir), aio)


@pytest.fixture(scope="session")
def flux_engine(tiny_flux_dir, aio):
    """The tiny FLUX.1 on plain diffusers (the parity oracle)."""
    from app.rollout.flux_engine import FluxEngine

    yield from _started(FluxEngine(tiny_flux_dir), aio)


@pytest.fixture(scope="session")
def z_image_engine(tiny_z_image_dir, aio):
    """The tiny Z-Image on plain diffusers (the parity oracle)."""
    from app.rollout.z_image_engine import ZImageEngine

    yield from _started(ZImageEngine(tiny_z_image_dir), aio)


@pytest.fixture(scope="session")
def wan_engine(tiny_wan_dir, aio):
    """The tiny Wan on plain diffusers (the parity oracle)."""
    from app.rollout.wan_engine import WanEngine

    yield from _started(WanEngine(tiny_wan_dir), aio)


@pytest.fixture(scope="session")
def serve_url(ray_cluster) -> str:
    """Serve on the session's cluster, its HTTP proxy on a free port (started once: every Serve test shares it)."""
    import socket

    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def bagel_engine(tiny_bagel_dir, aio):
    from app.rollout.bagel_engine import BagelEngine

    yield from _started(BagelEngine(tiny_bagel_dir), aio)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the session (logical CPUs above the 2 real ones: replicas ask for fractions)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # tests call the local cluster's CLI-free APIs only
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}})
    yield
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()



_JOB_CLUSTERS = []


@pytest.fixture(scope="session")
def job_cluster(tmp_path_factory):
    """The long-lived Ray cluster the session's job runs join (`job_runs.JobCluster`); stopped after the last
    `jobs` test, so that the tests after them have the cores."""
    from job_runs import JobCluster

    cluster = JobCluster(tmp_path_factory.mktemp("job_cluster"))
    _JOB_CLUSTERS.append(cluster)
    yield cluster
    cluster.stop()


def pytest_runtest_teardown(item, nextitem):
    if _JOB_CLUSTERS and (nextitem is None or nextitem.get_closest_marker("jobs") is None):
        _JOB_CLUSTERS.pop().stop()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, job_cluster) -> Path:
    """The tiny config as shipped (24 steps, 2 rollout replicas, OCR + JPEG reward, 2 FSDP2 workers), run once by
    `python -m jobs.train` on the job cluster: the uninterrupted run that the job, resume and fault-tolerance tests
    compare with. Its Serve application stays up (`--keep-serving`) for the fault run, which has the same
    sections."""
    from job_runs import run_job

    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    done = run_job(f"logging.dir={run_dir}", "--keep-serving", cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "reward curve:" in done.stdout and "LoRA adapter:" in done.stdout and "start-up:" in done.stdout
    return run_dir


@pytest.fixture
def world_of_one():
    """A process group of one rank in this process, as a Ray Train worker of a one-worker run has. An in-process
    vllm-omni engine of an earlier test in this process may have started one already: it is used as it is."""
    import torch.distributed as dist

    from tests.gloo import free_port

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield
    if owned:
        dist.destroy_process_group()
