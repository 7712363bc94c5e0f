"""Entry points: `python -m jobs.<name>` (or `ray job submit -- python -m jobs.<name>`)."""
