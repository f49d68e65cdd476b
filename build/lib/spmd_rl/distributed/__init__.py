"""Accelerator abstraction and device meshes; the only place that touches torch.cuda / torch_npu."""
