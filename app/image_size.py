"""The one rule for image sides, checked by the run config, the request record and the HTTP API alike."""

SIDE_MULTIPLE = 16  # the VAE's 8x downsampling, then 2x2 patches of latents


def side_problem(value) -> str | None:
    """Why `value` cannot be an image height or width (None when it can)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < SIDE_MULTIPLE or value % SIDE_MULTIPLE:
        return f"must be a positive multiple of {SIDE_MULTIPLE} (the VAE's 8x and 2x2 patching)"
    return None
