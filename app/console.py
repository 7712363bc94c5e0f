"""What a run prints. By default: the start-up summary, one progress line per step (rank 0) and the final summary,
plus every error and every warning that asks for action. `logging.verbose=true` adds the INFO logs of Ray, Ray
Train (its per-report metrics dicts), Serve, vllm and vllm-omni, and the warnings listed as harmless below.

Three levers, each the library's own: log levels at the source (Ray Train's `LoggingConfig`, Serve's
`logging_config`, `VLLM_LOGGING_LEVEL`, the loggers of this process), `TQDM_DISABLE` for the engines' loading
bars, and Ray's `RAY_DEDUP_LOGS_SKIP_REGEX`, which drops matching lines that workers forward to the driver.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys

# Lines every run prints that need no action (regex, why), dropped unless verbose. Anything else still shows.
KNOWN_HARMLESS = [
    # INFO that no log level reaches (Ray Train logs it on a logger named after its source file), once per rank
    (r"^Reporting training result \d+: ", "Ray Train's per-report metrics dict: the progress line has the numbers"),
    (r"^Checkpoint successfully created at", "the final summary names the checkpoint"),
    (r"Multi-thread loading shards", "vllm's weight-loading bar (it ignores TQDM_DISABLE)"),
    (r"^(\(\w+ pid=\d+\) )?\s*$", "the empty line a closed progress bar leaves"),
    # warnings
    (r"Token authentication is enabled for this Ray cluster", "Ray 2.60's default for a cluster it starts"),
    (r"Generated new authentication token", "the same, on first use"),
    (r"PYTHON worker processes have been started on node", "many small actors starting at once on few cores"),
    (r"Failed to import from vllm\._C_AVX2", "vllm's optional AVX2 kernels; the CPU path does without them"),
    (r"Failed to import from vllm\._C\b", "vllm's compiled kernels, absent on CPU; the CPU path uses torch ops"),
    (r"Reset SSM cache type", "vllm adjusting a setting of state-space models; the diffusion models have none"),
    (r"FlashInfer ring kernels are unavailable", "CUDA-only kernels, on a CPU machine"),
    (r"Model Runner V2 requires Triton", "vllm falls back to the V1 runner, which vllm-omni uses anyway"),
    (r"does not support torch inductor", "no torch.compile on the CPU platform"),
    (r"NVML init failed", "no NVIDIA driver on a CPU machine"),
    (r"has constructor arguments in the object store and max_restarts > 0", "Ray Train's own PreemptionWatcher"),
    (r"The text detection result is empty", "RapidOCR found no text: the OCR reward scores such an image 0"),
    (r"replicas that have taken more than \d+s to initialize|This may be caused by a slow __init__",
     "vllm-omni engines take ~40 s to start on 2 CPU cores"),
]
_HARMLESS = re.compile("|".join(f"(?:{pattern})" for pattern, _ in KNOWN_HARMLESS))
# INFO chatter of these loggers is off unless verbose (this process: the driver, a Train worker, a replica)
_CHATTY_LOGGERS = ("ray", "ray.serve", "ray.train", "RapidOCR")


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _HARMLESS.search(record.getMessage())


_DROP_HARMLESS = _DropHarmless()  # one instance: adding it again to a logger or handler is a no-op


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class PlainText:
    """A text stream that drops colour codes on the way (Ray colours its "[repeated Nx across cluster]" note with no
    setting to turn it off)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(_COLOUR.sub("", text))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def set_driver_env(verbose: bool) -> None:
    """Before `import ray` in the driver: forwarded worker lines that are known harmless are not printed, and
    worker lines carry no colour codes unless the console is a terminal (a log file or a pipe shows them as junk)."""
    if not verbose:
        os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", _HARMLESS.pattern)
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not stream.isatty() and not isinstance(stream, PlainText):
                setattr(sys, name, PlainText(stream))


def quiet_this_process(verbose: bool) -> None:
    """Loggers of this process: WARNING and above, minus the known-harmless warnings (nothing when verbose)."""
    if verbose:
        return
    # weight-loading and -writing progress bars (diffusers, transformers) of this process and of the workers it
    # starts: tqdm's own switch, and the Hugging Face libraries' (read when they are imported; already imported
    # ones are told directly)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for library in ("transformers", "diffusers"):
        if library in sys.modules:
            importlib.import_module(f"{library}.utils.logging").disable_progress_bar()
    for name in _CHATTY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
        logger.addFilter(_DROP_HARMLESS)  # records logged by this logger itself
    for name in ("", "ray"):  # records that propagate to the handlers of the root and `ray` loggers
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_DROP_HARMLESS)


def log_level(verbose: bool) -> str:
    """Level of Ray Train's and Serve's own logs (and of vllm inside the replicas)."""
    return "INFO" if verbose else "WARNING"


def replica_env(level: str) -> dict[str, str]:
    """Environment of the Serve replicas at a log level: vllm's level, and no weight-loading progress bars above
    INFO."""
    return {"VLLM_LOGGING_LEVEL": level, **({} if level in ("DEBUG", "INFO") else {"TQDM_DISABLE": "1"})}
