"""Deliberately broken kvtier parts for the negative controls: a spec whose worker loads wrong
bytes, and a secondary tier that promotes wrong bytes.

If the end-to-end comparison with the baseline could not tell right KV from wrong KV, the
positive tests would prove nothing; with this spec the same scenario must change the tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier
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


class WrongBytesDiskTier(KvtierDiskTier):
    """kvtier's secondary tier, except that every block it promotes is overwritten with wrong
    bytes once the verified read has landed in vLLM's primary row (the tiering-mode control)."""

    def submit_load(self, job_metadata):
        self._rows_of = getattr(self, "_rows_of", {})
        self._rows_of[job_metadata.job_id] = np.asarray(job_metadata.chunk_ids).tolist()
        super().submit_load(job_metadata)

    def get_finished_jobs(self):
        done = list(super().get_finished_jobs())
        rows_of = getattr(self, "_rows_of", {})
        # Rows of the promotions reported done now: their verified bytes have landed.
        wrong = [row for r in done if r.success for row in rows_of.pop(r.job_id, [])]
        if wrong:
            rows = np.frombuffer(self.pool, dtype=np.uint8).reshape(self.pool.num_slots, self.pool.slot_bytes)
            rng = np.random.default_rng(len(wrong))
            for row in wrong:
                # Small fp32 noise: plausible-looking, wrong KV.
                rows[row] = rng.standard_normal(self.pool.slot_bytes // 4, dtype=np.float32).view(np.uint8)
            del rows  # no export of vLLM's region may outlive the call (it unmaps it at shutdown)
        return done
