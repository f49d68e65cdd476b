"""What a run *is*, derived from its config: the stage graph and the mode predicates
(``graph``), the cross-field rules ``validate`` applies (``rules`` and the per-topic rule
modules), the training backends (``train_backends``), and the closed-form estimates and
``plan`` text. ``config/`` below it holds only the schema, the loader, the layouts and the
model inventory."""
