"""HTTP ingress (FastAPI), OpenAI images shape plus FlowGRPO extensions.

    POST /v1/images/generations   {prompt, n, size "WxH", response_format "b64_json", num_inference_steps, seed,
                                   noise_level, sde_type, guidance, negative_prompt, return_trajectory}
    POST /v1/images/edits         multipart form: image (PNG/JPEG file), prompt (what to change), and the fields
                                  above plus image_guidance (BAGEL deployments; the group edits one image)
    POST /v1/videos/generations   a video family's (Wan): the fields above plus num_frames or seconds (at fps, 16 by
                                  default) → {data: [{b64_mp4}], ...} and the trajectory as above
    POST /v1/rewards              {images: [base64 PNG/JPEG], prompts: [...]} → {scores, components}
    GET  /v1/health               rollout and reward replicas answer
    GET  /v1/lora                 adapter version of every rollout replica, and the published one

Every request is validated here, before a replica sees it: a bad one gets a 4xx JSON error that says what to
change (`{"error": {"message", "type", "param"}}`), and the replicas keep serving. A `RequestError` a rollout
replica raises (a check only the engine can make) is a 400 naming its field too, and any other failure is a JSON
500 (`"type": "server_error"`), never a plain-text one. The class is wrapped with `serve.ingress` in builders.py.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import time
from types import SimpleNamespace
from typing import Annotated, Literal

import numpy as np
import torch
from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from app.config import RolloutConfig, SdeType, ServeConfig
from app.image_size import side_problem
from app.metrics import mp4_bytes
from app.models.family import FAMILY_NAMES, get_family
from app.types import MAX_SEED, GenerationRequest, RequestError, Trajectory
from deployments.auth import LOOPBACK, OPEN_PATHS, KeyCheck

logger = logging.getLogger(__name__)


class ImageGenerationBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="text to render; for the OCR reward put the text in double quotes")
    n: int = Field(1, ge=1, description="images in the prompt group")
    size: str | None = Field(None, pattern=r"^\d{1,5}x\d{1,5}$", description='"WIDTHxHEIGHT", multiples of 16')
    response_format: Literal["b64_json"] = "b64_json"
    model: str | None = Field(None, description="accepted for OpenAI compatibility; the deployment serves one model")
    num_inference_steps: int | None = Field(None, ge=2)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    noise_level: float | None = Field(None, ge=0, le=10)
    sde_type: SdeType | None = None
    guidance: float | None = Field(None, ge=1, le=30)
    negative_prompt: str | None = None
    embedded_guidance: float | None = Field(None, ge=0, le=30, description="a guidance-distilled model's guidance "
                                            "input (FLUX.1-dev); default: the deployment's")
    return_trajectory: bool = False


class VideoGenerationBody(ImageGenerationBody):
    """A group of videos: the generation fields, and how long each is, in frames or in seconds (not both)."""

    num_frames: int | None = Field(None, ge=1, description="frames of each video (Wan: 4k + 1, e.g. 33 or 81); "
                                   "default: the deployment's")
    seconds: float | None = Field(None, gt=0, description="how long each video lasts at `fps`: seconds·fps + 1 frames")
    fps: int = Field(16, ge=1, le=60, description="frames a second of the returned mp4s (Wan's: 16)")


class ImageEditForm(ImageGenerationBody):
    """OpenAI's images/edits form: the image to edit and what to change, with the generation fields."""

    image: UploadFile = Field(description="the image to edit: a PNG or JPEG file")
    image_guidance: float | None = Field(None, ge=1, le=30, description="BAGEL's image CFG scale (cfg_img_scale)")


EDIT_FORM_SCHEMA = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"$ref": "#/components/schemas/ImageEditForm"}}}}}


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    images: list[str] = Field(min_length=1, description="base64-encoded PNG or JPEG images")
    prompts: list[str] = Field(min_length=1, description="one prompt per image")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, *, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """The OpenAI error shape, as the official client parses it."""
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


app = FastAPI(title="ray-flowgrpo", version="0.1.0",
              description="FlowGRPO rollouts (vllm-omni) and rewards on Ray Serve")
# the replica's API keys, Retry-After and body limit, set by its ApiIngress: a module global, since Serve serves a
# copy of `app` (serve.ingress freezes it), whose middleware functions are still this module's
_ACCESS = SimpleNamespace(keys=KeyCheck([]), retry_after_s=5.0, max_body_bytes=64 * 2**20)


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message, where = "the request body is not valid JSON", None
    elif where is None and first.get("type") == "missing":
        message = "a JSON request body is required"
    elif where:
        message = f"{where}: {message}"
    return _error(422, message, where)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.param, exc.kind, exc.code, exc.headers)


async def _unless_busy(call):
    """The replicas' answer to `call` (a DeploymentResponse); a 503 with Retry-After at once when every replica is
    busy and the queue is at serve.max_queued_requests (Serve's own answer would be plain text, without it)."""
    try:
        return await call
    except BackPressureError as exc:
        retry = _ACCESS.retry_after_s
        raise ApiError(503, f"every replica is busy and {exc.args[1]} requests already wait: retry in {retry:g} s",
                       kind="server_error", code="overloaded",
                       headers={"Retry-After": str(max(1, round(retry)))}) from None


# GenerationRequest fields that the API's body names otherwise
API_PARAMS = {"height": "size", "width": "size", "guidance_scale": "guidance", "image_guidance_scale": "image_guidance",
              "embedded_guidance_scale": "embedded_guidance"}


def _unwrapped(exc: BaseException) -> BaseException:
    """The exception as the replica raised it: Ray re-raises a replica's exception as a RayTaskError that is also
    an instance of its class (so the handlers below match it), but whose message is the remote traceback."""
    while isinstance(exc, RayTaskError):
        exc = exc.cause
    return exc


@app.exception_handler(RequestError)
async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    """A request GenerationRequest's rules refuse: built here, or checked again by the rollout replica."""
    exc = _unwrapped(exc)
    return _error(400, str(exc), API_PARAMS.get(exc.field, exc.field))


@app.middleware("http")
async def _limit_body(request: Request, call_next):
    """A body over serve.max_body_bytes is a 413 before it is read; a POST must say its length (411 otherwise)."""
    if request.method == "POST":
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            return _error(411, "send the body with a Content-Length header", code="length_required")
        if int(length) > _ACCESS.max_body_bytes:
            return _error(413, f"the body is {int(length)} bytes; this deployment takes at most "
                               f"{_ACCESS.max_body_bytes} (serve.max_body_bytes)", code="body_too_large")
    return await call_next(request)


@app.middleware("http")
async def _authorize(request: Request, call_next):
    """With API keys set (deployments/auth.py), every route but /v1/health needs `Authorization: Bearer <key>`."""
    check = _ACCESS.keys
    if (check.required and not request.url.path.endswith(OPEN_PATHS)
            and (problem := check.problem(request.headers.get("authorization"))) is not None):
        return _error(401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await call_next(request)


@app.middleware("http")
async def _server_error(request: Request, call_next):
    """Whatever no handler above answers (a replica's crash, a bug) is a JSON 500 in the API's error format.
    A middleware, not an exception handler for Exception: Starlette runs that one in ServerErrorMiddleware, which
    raises the exception again after answering, into Serve's replica."""
    try:
        return await call_next(request)
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.url.path)
        cause = _unwrapped(exc)
        return _error(500, f"the server failed: {type(cause).__name__}: {cause}", kind="server_error")


def _png_b64(image: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def trajectory_b64(traj: Trajectory) -> str:
    """The trajectory's tensors as base64 safetensors; scalar fields go into the metadata."""
    from safetensors.torch import save

    tensors = {k: v.contiguous() for k, v in traj.tensors().items() if k != "images"}
    metadata = {k: str(getattr(traj, k)) for k in ("prompt", "family", "noise_level", "sde_type", "seed",
                                                     "lora_version", "height", "width", "num_frames", "guidance_scale",
                                                     "embedded_guidance_scale", "sde_window",
                                                     "image_guidance_scale", "cfg_interval", "cfg_renorm",
                                                     "cfg_renorm_min", "sample_offset")}
    return base64.b64encode(save(tensors, metadata=metadata)).decode()


def _decode_b64_image(data: str, index: int, max_bytes: int) -> np.ndarray:
    param = f"images.{index}"
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param} is not valid base64", param) from None
    return _decode_image(raw, param, max_bytes)


def _decode_image(raw: bytes, param: str, max_bytes: int) -> np.ndarray:
    """uint8 [H, W, 3] of a PNG or JPEG file, or a 4xx naming `param`."""
    from PIL import Image, UnidentifiedImageError

    if len(raw) > max_bytes:
        raise ApiError(413, f"{param} is {len(raw)} bytes; the limit is {max_bytes}", param)
    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.width * im.height > 4096 * 4096:
                raise ApiError(413, f"{param} is {im.width}x{im.height}; at most 4096x4096 pixels", param)
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        raise ApiError(400, f"{param} is not a PNG or JPEG image", param) from None


def _http_host() -> str | None:
    """The address Serve's HTTP proxy listens on (serve_config.yaml's http_options.host); None when unknown."""
    import ray

    if not ray.is_initialized():  # an ingress built outside Serve (a test): asking would start a Ray instance
        return None
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:
        return None


class ApiIngress:
    def __init__(self, rollout, reward, adapters=None, *, sampling: RolloutConfig | None = None,
                 limits: ServeConfig | None = None, family: str = "qwen_image", key_digests: list[str] = ()):
        """rollout, reward, adapters: DeploymentHandles; a request that leaves a sampling setting out gets
        `sampling`'s (the rollout section); `limits`: what one request may ask for (the serve section); `family`:
        the served model's (edits need BAGEL); key_digests: the API keys' (deployments/auth.py; none: open)."""
        self.rollout, self.reward, self.adapters = rollout, reward, adapters
        self.sampling, self.limits = sampling or RolloutConfig(), limits or ServeConfig()
        self.family = get_family(family)
        _ACCESS.keys = KeyCheck(list(key_digests))  # this replica's: the middleware above reads it
        _ACCESS.retry_after_s, _ACCESS.max_body_bytes = self.limits.retry_after_s, self.limits.max_body_bytes
        if not key_digests and (host := _http_host()) not in LOOPBACK | {None}:
            logger.warning("the HTTP API listens on %s without API keys: anyone who reaches the port can spend the "
                           "replicas' GPUs. Set %s=<key>[,<key>...] (or serve.api_key_file) where you run "
                           "`serve run`, and clients send `Authorization: Bearer <key>`", host, self.limits.api_key_env)

    def _generation_request(self, body: ImageGenerationBody, **extra) -> GenerationRequest:
        lim, d = self.limits, self.sampling
        if body.n > lim.max_n:
            raise ApiError(400, f"n={body.n} is more than this deployment's limit of {lim.max_n}", "n")
        width, height = (int(v) for v in body.size.split("x")) if body.size else (d.width, d.height)
        for name, value in (("width", width), ("height", height)):
            if problem := side_problem(value):
                raise ApiError(400, f"size={body.size!r}: {name} {value} {problem}", "size")
            if value > lim.max_side:
                raise ApiError(400, f"size={body.size!r}: {name} {value} is over the limit of {lim.max_side}", "size")
        steps = body.num_inference_steps or d.num_inference_steps
        if steps > lim.max_steps:
            raise ApiError(400, f"num_inference_steps={steps} is over the limit of {lim.max_steps}",
                           "num_inference_steps")
        if body.embedded_guidance is not None and not self.family.embedded_guidance:
            raise ApiError(400, f"embedded_guidance: this deployment serves {self.family.name}, which takes no "
                                "guidance input; its CFG scale is `guidance`", "embedded_guidance")
        given = {"guidance_scale": body.guidance, "negative_prompt": body.negative_prompt,
                 "noise_level": body.noise_level, "sde_type": body.sde_type,
                 "embedded_guidance_scale": body.embedded_guidance}
        # a RequestError here is a 400 naming the field (the handler above)
        return d.request(body.prompt, n=body.n, height=height, width=width, num_inference_steps=steps,
                         seed=body.seed, **{k: v for k, v in given.items() if v is not None}, **extra)

    @app.post("/v1/images/generations")
    async def generate_images(self, body: ImageGenerationBody) -> dict:
        if self.family.video:
            raise ApiError(400, f"this deployment serves {self.family.name}, which generates videos: POST "
                                "/v1/videos/generations", "prompt")
        return await self._respond(self._generation_request(body), body)

    @app.post("/v1/videos/generations")
    async def generate_videos(self, body: VideoGenerationBody) -> dict:
        if not self.family.video:
            raise ApiError(400, f"this deployment serves {self.family.name}, which generates images: POST "
                                "/v1/images/generations", "prompt")
        request = self._generation_request(body, num_frames=self._frames(body))
        traj: Trajectory = await _unless_busy(self.rollout.generate.remote(request))
        return self._response(traj, body, {"data": [{"b64_mp4": base64.b64encode(mp4_bytes(video, body.fps)).decode()}
                                                    for video in traj.images.numpy()],
                                           "num_frames": traj.num_frames, "fps": body.fps})

    def _frames(self, body: VideoGenerationBody) -> int:
        """Frames of each video the body asks for: num_frames, or seconds at fps, or the deployment's."""
        if body.num_frames is not None and body.seconds is not None:
            raise ApiError(400, "give num_frames or seconds, not both", "seconds")
        param, frames = "num_frames", body.num_frames
        if body.seconds is not None:
            param, frames = "seconds", round(body.seconds * body.fps) + 1
        frames = self.sampling.num_frames if frames is None else frames
        if frames > self.limits.max_frames:
            raise ApiError(400, f"{param}: {frames} frames is over this deployment's limit of {self.limits.max_frames}"
                                " (serve.max_frames)", param)
        if (why := self.family.frames_problem(frames)) is not None:
            given = f"{body.seconds:g} s at {body.fps} fps is {frames} frames, which " if param == "seconds" else ""
            raise ApiError(400, f"{param}: {given}{why}", param)
        return frames

    @app.post("/v1/images/edits", openapi_extra=EDIT_FORM_SCHEMA)
    async def edit_images(self, form: Annotated[ImageEditForm, Form(media_type="multipart/form-data")]) -> dict:
        if not self.family.supports_edits:
            editing = [name for name in FAMILY_NAMES if get_family(name).supports_edits]
            raise ApiError(400, f"this deployment serves {self.family.name}, which generates from text only: edits "
                                f"need a deployment of model.family={' or '.join(editing)}", "image")
        raw = await form.image.read(self.limits.max_image_bytes + 1)
        image = torch.from_numpy(_decode_image(raw, "image", self.limits.max_image_bytes))
        extra = {"image": image}
        if form.image_guidance is not None:
            extra["image_guidance_scale"] = form.image_guidance
        return await self._respond(self._generation_request(form, **extra), form)

    async def _respond(self, request: GenerationRequest, body: ImageGenerationBody) -> dict:
        traj: Trajectory = await _unless_busy(self.rollout.generate.remote(request))
        return self._response(traj, body, {"data": [{"b64_json": _png_b64(im)} for im in traj.images.numpy()]})

    def _response(self, traj: Trajectory, body: ImageGenerationBody, media: dict) -> dict:
        response = {"created": int(time.time()), **media, "seed": traj.seed, "lora_version": traj.lora_version,
                    "replica": traj.producer.get("replica")}
        if body.return_trajectory:
            response["trajectory"] = {"format": "safetensors", "b64": trajectory_b64(traj)}
        return response

    @app.post("/v1/rewards")
    async def score_images(self, body: RewardBody) -> dict:
        lim = self.limits
        if len(body.images) != len(body.prompts):
            raise ApiError(400, f"{len(body.images)} images but {len(body.prompts)} prompts: one prompt per image",
                           "prompts")
        if len(body.images) > lim.max_reward_images:
            raise ApiError(400, f"{len(body.images)} images; the limit is {lim.max_reward_images}", "images")
        decoded = [_decode_b64_image(data, i, lim.max_image_bytes) for i, data in enumerate(body.images)]
        shapes = {im.shape for im in decoded}
        if len(shapes) != 1:
            raise ApiError(400, f"images differ in size {sorted(shapes)}; send one size per request", "images")
        scores = await _unless_busy(self.reward.score.remote(np.stack(decoded), body.prompts))
        return {"scores": scores.total, "components": scores.components}

    @app.get("/v1/health")
    async def health(self) -> dict:
        rollout = await self.rollout.health.remote()
        reward = await self.reward.info.remote()
        return {"status": "ok", "rollout": rollout, "reward": reward}

    @app.get("/v1/lora")
    async def lora(self) -> dict:
        answers = await self.rollout.broadcast("lora_version").results_async(return_exceptions=True)
        versions = [a for a in answers if not isinstance(a, BaseException)]  # a replica that just died: left out
        published = (await self.adapters.current.remote())[0] if self.adapters is not None else None
        return {"replicas": versions, "versions": sorted({v["lora_version"] for v in versions}),
                "published": published}
