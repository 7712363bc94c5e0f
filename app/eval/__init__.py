"""Held-out evaluation: eval sets, the evaluation of an adapter through the Serve application, sentinels."""
