"""A video group's way from a rollout replica to the trainer: the bytes of its trajectory and the seconds of
`ray.get` for the two transports.

    python -m jobs.bench_trajectory_transport [--height 480] [--width 832] [--frames 33] [--group 4] [--steps 10]
                                              [--channels 16] [--repeats 3]

The trajectory has the shapes of a Wan2.1-T2V-1.3B group (fp32 latents [n, T+1, 16, F', H/8, W/8] of every step,
uint8 frames [n, F, H, W, 3], UMT5 states [512, 4096]), random values, made once in a Ray actor as a replica makes
it. `trajectory`: the `Trajectory` as the application sends it (its tensors as numpy arrays: pickle 5's
out-of-band buffers, written once into the object store and read there in place); `torch`: the same tensors
pickled as torch tensors (torch's own pickling: the bytes go into the pickle and come out as new tensors). The
trainer's side touches every byte (a sum) after the get, as scoring does. Prints one JSON line: bytes, and the
median seconds of --repeats of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from app.types import GenerationRequest, Trajectory
from jobs.report import emit_json_line


def video_group(height: int, width: int, frames: int, group: int, steps: int, channels: int) -> Trajectory:
    request = GenerationRequest("a cat walks", height=height, width=width, num_frames=frames, n=group,
                                num_inference_steps=steps, noise_level=0.7, sde_type="sde")
    shape = (channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    return Trajectory.sampled(
        request, seed=0, lora_version=0, family="wan",
        images=torch.randint(0, 256, (group, frames, height, width, 3), dtype=torch.uint8),
        latents=torch.randn(group, steps + 1, *shape), log_probs=torch.randn(group, steps),
        timesteps=torch.linspace(1000, 100, steps), sigmas=torch.linspace(1, 0, steps + 1),
        prompt_embeds=torch.randn(512, 4096), prompt_mask=torch.ones(512, dtype=torch.long),
        conditioning={"expand_timesteps": torch.tensor(False)})


@ray.remote(num_cpus=0)
class Replica:
    def __init__(self, *shape):
        self.traj = video_group(*shape)

    def trajectory(self) -> Trajectory:
        return self.traj

    def torch(self) -> dict:
        return {"tensors": self.traj.tensors(), "prompt": self.traj.prompt}


def touched(value) -> float:
    tensors = value.tensors() if isinstance(value, Trajectory) else value["tensors"]
    return sum(float(t.float().sum()) if t.dtype != torch.uint8 else float(t.sum()) for t in tensors.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    replica = Replica.remote(args.height, args.width, args.frames, args.group, args.steps, args.channels)
    nbytes = ray.get(replica.trajectory.remote()).nbytes  # also: the actor is up
    seconds = {}
    for kind in ("trajectory", "torch"):
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            touched(ray.get(getattr(replica, kind).remote()))
            times.append(time.perf_counter() - began)
        seconds[kind] = statistics.median(times)
    emit_json_line({"bench": "trajectory_transport", "height": args.height, "width": args.width,
                    "frames": args.frames, "group": args.group, "steps": args.steps,
                    "trajectory_mb": round(nbytes / 2**20, 1), "seconds": {k: round(v, 3) for k, v in seconds.items()},
                    "torch_over_trajectory": round(seconds["torch"] / seconds["trajectory"], 2)})
    ray.shutdown()


if __name__ == "__main__":
    main()
