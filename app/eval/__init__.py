"""Held-out evaluation: the evaluation of an adapter through the Serve application, and sentinels (the eval sets
themselves: app.prompt_sets)."""
