"""Starting jobs: torchrun for the local node, with the embedded etcd and the job token."""
