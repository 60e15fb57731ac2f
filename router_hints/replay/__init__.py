"""`kvcr replay`: a request trace through simulated workers, routed by the product's own index
and cost model (docs/replay.md)."""
