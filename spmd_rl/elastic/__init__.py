"""Replicas that outlive a peer's loss: membership agreed through etcd (``quorum``) and the
cross-replica process group rebuilt in place (``replica_group``)."""
