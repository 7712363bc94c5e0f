"""Sentinel statistics on synthetic images whose values are worked out by hand (float64 numpy, no model)."""

import math

import numpy as np
import pytest

from app.eval.sentinels import brightness, colour_entropy, dark_fraction, distance, edge_energy, out_of_band, sentinels


def flat(value, size=8) -> np.ndarray:
    return np.full((size, size, 3), value, dtype=np.uint8)


def checkerboard(size=8) -> np.ndarray:
    """One-pixel black and white squares: every neighbouring pair differs by the whole luminance range."""
    i, j = np.indices((size, size))
    return np.repeat(((i + j) % 2 * 255).astype(np.uint8)[..., None], 3, axis=2)


def test_a_flat_image_has_no_colour_entropy_and_no_edges():
    for value in (0, 77, 255):
        assert colour_entropy(flat(value)) == 0.0
        assert edge_energy(flat(value)) == 0.0


def test_a_checkerboard_has_the_largest_edge_energy_and_one_bit_of_colour():
    # luminance 0 and 1 alternate: (0 - 1)^2 = 1 for every horizontal and vertical pair, the mean of both is 1
    assert edge_energy(checkerboard()) == pytest.approx(1.0, abs=1e-12)
    assert colour_entropy(checkerboard()) == pytest.approx(1.0)  # two colours, half the pixels each
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    assert edge_energy(noise) < edge_energy(checkerboard())


def test_colour_entropy_counts_quantised_colours():
    # four colours in equal shares, each in a different cell of the 8-level grid: log2(4) = 2 bits
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    image[:2, :2], image[:2, 2:], image[2:, :2], image[2:, 2:] = (255, 0, 0), (0, 255, 0), (0, 0, 255), (0, 0, 0)
    assert colour_entropy(image) == pytest.approx(2.0)
    # 0..31 fall in one level: shades too close to tell apart are one colour
    image[:] = 0
    image[:2] = 31
    assert colour_entropy(image) == 0.0
    # shares 3/4 and 1/4: -(3/4 log2 3/4 + 1/4 log2 1/4) = 0.8113
    image[:] = 0
    image[0, :] = 200
    assert colour_entropy(image) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))


def test_brightness_dark_fraction_and_distance():
    white, black = flat(255), flat(0)
    assert brightness(white) == pytest.approx(1.0) and brightness(black) == 0.0
    half = white.copy()
    half[:4] = 0  # the top half black
    assert brightness(half) == pytest.approx(0.5) and dark_fraction(half) == pytest.approx(0.5)
    # pure red: luminance 0.299 (BT.601), not dark
    red = np.zeros((2, 2, 3), dtype=np.uint8)
    red[..., 0] = 255
    assert brightness(red) == pytest.approx(0.299) and dark_fraction(red) == 0.0
    assert distance(white, black) == pytest.approx(1.0) and distance(half, half) == 0.0
    assert distance(half, white) == pytest.approx(math.sqrt(0.5))  # half the pixels differ by 1


def test_sentinels_against_the_base_and_the_warning_bands():
    base = np.stack([checkerboard(), flat(128)])  # [2, 8, 8, 3]
    same = sentinels(base, base)
    assert same["distance_to_base"] == 0.0 and all(same[f"{k}_change"] == 0.0 for k in
                                                   ("colour_entropy", "edge_energy", "brightness", "dark_fraction"))
    erased = np.stack([flat(255), flat(255)])  # what an erased background looks like: all white
    values = sentinels(erased, base)
    # base entropy: (1 + 0) / 2 = 0.5 bit; adapter 0: change (0 - 0.5) / 0.5 = -1
    assert values["colour_entropy_base"] == pytest.approx(0.5) and values["colour_entropy_change"] == pytest.approx(-1)
    assert values["edge_energy_change"] == pytest.approx(-1.0)  # (0 - 0.5) / 0.5
    assert values["brightness_change"] == pytest.approx(1.0 - (0.5 + 128 / 255) / 2)
    assert values["dark_fraction_change"] == pytest.approx(-0.25)  # half of the checkerboard was dark
    bands = {"colour_entropy_change": [-0.3, 0.3], "distance_to_base": [0.0, 0.5], "brightness_change": [-1, 1]}
    assert set(out_of_band(values, bands)) == {"colour_entropy_change", "distance_to_base"}
    assert out_of_band(same, bands) == {}
    with pytest.raises(ValueError, match="same prompts, seeds and size"):
        sentinels(erased[:1], base)
