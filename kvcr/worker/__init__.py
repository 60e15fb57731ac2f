"""`kvcr worker`: a small CPU transformer behind SGLang-compatible routes, its KV pages in a runner."""
