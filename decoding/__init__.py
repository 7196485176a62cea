"""The Ray-free core: rejection sampling, sampling parameters, model execution with rollback-able
KV caches (per sequence, or batched over a paged block cache), proposers, and the in-process reference
generator. Pure or single-process; no Ray here."""
