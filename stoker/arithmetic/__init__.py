"""A run's arithmetic, from its config alone and torch-free, shared by the flow and the ranks:
the plan (memory per device, tokens, FLOPs, time and cost: ``plan``), the learning rate over the
steps and whether a checkpoint may be gone on from under another schedule (``schedule``), the
data order of a mixture (``mixture``), the bytes each token id stands for (``token_bytes``) and the gains
since a base (``gains``)."""
