"""The FSDP backend (``actor.backend: fsdp``): ``engine.TrainEngine``, FSDP2 over the training
mesh with DTensor tensor parallelism (``parallelize``), for every role and head (causal LM,
value model, reward model)."""
