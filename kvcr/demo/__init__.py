"""`kvcr demo`: a router, N workers and a workload on one machine, checked by an oracle."""
