"""Platform glue that makes the pinned ML stack run on machines without a GPU."""
