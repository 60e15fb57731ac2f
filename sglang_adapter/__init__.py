"""SGLang HiCache storage backend for kvcr (`--hicache-storage-backend kvcr`)."""
