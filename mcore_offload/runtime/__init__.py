"""The offload runtime: handler per (model chunk, microbatch), the step manager, and the patch-site API."""
