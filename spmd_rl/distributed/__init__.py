"""A rank's place among the others and its process's life: the accelerator abstraction and
device meshes (the only place that touches torch.cuda / torch_npu), collective timeouts, the
master port, the trace timeline, how a rank exits (``teardown``) and what must die with it
(``orphan_watch``)."""
