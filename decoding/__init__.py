"""The Ray-free core: rejection sampling, sampling parameters, model execution with rollback-able
KV caches, proposers, and the in-process reference generator. Pure or single-process; no Ray here."""
