"""Ray Serve: thin deployment classes around app/ objects, the HTTP ingress, app builders and the trainer's
client. `ray.serve` appears only in this package."""
