"""A deliberately broken kvtier spec for the negative control: its worker loads wrong bytes.

If the end-to-end comparison with the baseline could not tell right KV from wrong KV, the
positive tests would prove nothing; with this spec the same scenario must change the tokens.
"""

from __future__ import annotations

import torch

from kvtier_rs.integrations.vllm.spec import KvtierOffloadingSpec
from kvtier_rs.integrations.vllm.worker import KvtierWorker


class WrongBytesWorker(KvtierWorker):
    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        ok = super().submit_load(job_id, src_spec, dst_spec, expedited)
        # Let the real copy land first (the transfer engine copies asynchronously), then
        # overwrite what was loaded with plausible-looking but wrong KV (small fp32 noise).
        self.wait({job_id})
        gen = torch.Generator().manual_seed(job_id)
        for g, blocks, _slots, _subs in self._positions(dst_spec, src_spec.block_ids):
            bt = torch.from_numpy(blocks)
            for r in self.layouts[g].regions:
                noise = torch.randn((len(blocks), r.bytes_per_block // 4), generator=gen).view(torch.int8)
                r.tensor[bt, : r.bytes_per_block] = noise
        return ok


class WrongBytesSpec(KvtierOffloadingSpec):
    worker_cls = WrongBytesWorker
