"""The dock reads its DockConfig fields (real etcd, real warehouse, one process): the bind
interface, the reply bucket size and the default get timeout."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.recipe.graph import Stage
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.metadata import MetadataStore

TOKEN = "unit-test-token-0123456789abcdef"
STAGES = [Stage("actor_rollout", ("prompt_ids",), ("response_ids",))]


@pytest.mark.timeout(120)
def test_interface_bucket_and_timeout(etcd):
    meta = MetadataStore([etcd.endpoint], job="dock-fields")
    cfg = DockConfig(port=0, interface="127.0.0.3", bucket_bytes=16, get_timeout_s=1.0)
    d = TransferDock(
        cfg, meta, specs_of(column_decls(STAGES)), Peer(0, 1, 0, 0, 1), TOKEN, in_process=False
    ).start()  # over the wire: the chunks
    try:
        assert d.server.address.startswith("tcp://127.0.0.3:")  # bound where the config says
        d.begin_iteration(0, 4)
        values = [torch.arange(n, dtype=torch.int32) for n in (1, 2, 3, 4)]  # 4, 8, 12, 16 bytes
        d.put("data", 0, {"prompt_ids": values}, [0, 1, 2, 3])
        # chunks of at most 16 bytes unless one sample is larger: [0, 1], [2], [3]
        assert len(d.server._reply_get(0, [0, 1, 2, 3], ["prompt_ids"])) == 3
        got = d.get("actor_rollout", 0, ["prompt_ids"], Layout(1, 1)).columns["prompt_ids"]
        assert all(torch.equal(a, b) for a, b in zip(got, values))  # reassembled from the chunks
        with pytest.raises(DockTimeout):  # waits get_timeout_s (1 s), not the 600 s default
            d.get("actor_rollout", 0, ["response_ids"], Layout(1, 1))
    finally:
        d.close()
