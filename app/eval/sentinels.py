"""Sentinels against reward hacking: statistics of an adapter's images set against the base model's images of the
same prompts and seeds. Pure numpy; images are uint8 [..., H, W, 3].

A reward can be gamed by images a person would reject: OCR training that erases backgrounds (UniRL measured −54%
colour entropy), grid artefacts (flow_grpo issues #92, #204, #233), images that drift dark or washed out. Each
statistic is per image, then averaged:

    colour_entropy   Shannon entropy (bits) of the image's colours, each channel quantised to 8 levels (512 colours):
                     0 for a flat image, at most 9
    edge_energy      mean squared luminance step between neighbouring pixels, horizontal and vertical pairs averaged:
                     0 for a flat image, 1 (the most there is) for a one-pixel black and white checkerboard
    brightness       mean luminance (ITU-R BT.601 weights, in [0, 1])
    dark_fraction    share of pixels with luminance below 0.1
    distance_to_base root mean square difference to the base model's image of the same prompt and seed, in [0, 1]

How far an adapter's statistic moved: `<name>_change`, relative to the base for colour entropy and edge energy
((adapter − base) / base, the base floored at 0.1 bit and 1e-4), the plain difference for brightness and dark
fraction (shares already). A warning band (`eval.sentinel_bands`) bounds each change and the distance.
"""

from __future__ import annotations

import numpy as np

LEVELS = 8  # quantisation levels per channel of the colour histogram
DARK = 0.1  # luminance below which a pixel counts as dark
_LUMA = np.array([0.299, 0.587, 0.114])
STATISTICS = ("colour_entropy", "edge_energy", "brightness", "dark_fraction")
RELATIVE = {"colour_entropy": 0.1, "edge_energy": 1e-4}  # changes taken relative to the base (floor of the base)
# default warning bands of the changes and the distance (the config's `eval.sentinel_bands`)
DEFAULT_BANDS = {"colour_entropy_change": [-0.3, 0.3], "edge_energy_change": [-0.5, 1.0],
                 "brightness_change": [-0.15, 0.15], "dark_fraction_change": [-0.2, 0.2],
                 "distance_to_base": [0.0, 0.5]}


def luminance(images: np.ndarray) -> np.ndarray:
    """[..., H, W] luminance in [0, 1] of uint8 [..., H, W, 3] images."""
    return images.astype(np.float64) @ _LUMA / 255.0


def colour_entropy(image: np.ndarray) -> float:
    """Entropy in bits of the image's colour histogram (8 levels per channel)."""
    q = image.astype(np.int64) * LEVELS // 256  # 0..7 per channel
    codes = (q[..., 0] * LEVELS + q[..., 1]) * LEVELS + q[..., 2]
    p = np.bincount(codes.ravel(), minlength=LEVELS**3) / codes.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: -0.0 of a flat image prints as 0


def edge_energy(image: np.ndarray) -> float:
    """Mean squared luminance difference of horizontally and vertically adjacent pixels (the two means averaged)."""
    y = luminance(image)
    return float((np.mean(np.diff(y, axis=1) ** 2) + np.mean(np.diff(y, axis=0) ** 2)) / 2)


def brightness(image: np.ndarray) -> float:
    return float(luminance(image).mean())


def dark_fraction(image: np.ndarray) -> float:
    return float((luminance(image) < DARK).mean())


def distance(image: np.ndarray, base: np.ndarray) -> float:
    """Root mean square difference of two images of one size, in [0, 1]."""
    diff = (image.astype(np.float64) - base.astype(np.float64)) / 255.0
    return float(np.sqrt(np.mean(diff**2)))


_FUNCTIONS = {"colour_entropy": colour_entropy, "edge_energy": edge_energy, "brightness": brightness,
              "dark_fraction": dark_fraction}


def image_statistics(images: np.ndarray) -> dict[str, float]:
    """Each statistic, averaged over uint8 [N, H, W, 3] images."""
    return {name: float(np.mean([f(im) for im in images])) for name, f in _FUNCTIONS.items()}


def sentinels(images: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """The adapter's statistics, the base's (`<name>_base`), their changes and the mean distance to the base, for
    images [N, H, W, 3] and the base model's images of the same prompts and seeds, in the same order."""
    if images.shape != base.shape:
        raise ValueError(f"adapter images {list(images.shape)} and base images {list(base.shape)} differ in shape: "
                         "the base images must come from the same prompts, seeds and size")
    if images.ndim == 5:  # videos [N, F, H, W, 3]: the statistics of their frames
        images, base = images.reshape(-1, *images.shape[2:]), base.reshape(-1, *base.shape[2:])
    mine, ref = image_statistics(images), image_statistics(base)
    out = {}
    for name in STATISTICS:
        out[name], out[f"{name}_base"] = mine[name], ref[name]
        if name in RELATIVE:
            out[f"{name}_change"] = (mine[name] - ref[name]) / max(ref[name], RELATIVE[name])
        else:
            out[f"{name}_change"] = mine[name] - ref[name]
    out["distance_to_base"] = float(np.mean([distance(a, b) for a, b in zip(images, base, strict=True)]))
    return out


def out_of_band(values: dict[str, float], bands: dict[str, list[float]]) -> dict[str, tuple[float, list[float]]]:
    """{name: (value, [lo, hi])} of every banded value outside its band."""
    return {name: (values[name], band) for name, band in bands.items()
            if name in values and not band[0] <= values[name] <= band[1]}
