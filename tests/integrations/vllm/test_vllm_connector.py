"""KvtierConnector's additions to vLLM's OffloadingConnector, on the class itself (no engine):
its configuration check at vLLM's first class-level call with the configuration, and which
series it creates at start-up. tests/integrations/vllm/test_vllm_serve.py scrapes the start-up series from a
real `vllm serve`."""

from __future__ import annotations

import pytest
from support.vllm import engine as E

E.require_vllm()  # fail, never skip: CI installs vLLM

from kvtier_rs._core import InvalidArgumentError  # noqa: E402
from kvtier_rs.integrations.vllm import metrics as m  # noqa: E402
from kvtier_rs.integrations.vllm.connector import KvtierConnector, _known_label_values  # noqa: E402

MODULE = "kvtier_rs.integrations.vllm"
EXTRA = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": MODULE, "cpu_bytes_to_use": "1GiB"}


def test_vllm_loads_the_connector_by_name_from_the_package():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=EXTRA,
    )
    assert KVConnectorFactory.get_connector_class(cfg) is KvtierConnector
    assert KVConnectorFactory.supports_hma_config(cfg), "the hybrid KV cache manager stays on, as for vLLM's"


def test_a_good_configuration_passes_and_asks_for_no_piecewise_mode():
    assert KvtierConnector.requires_piecewise_for_cudagraph(dict(EXTRA)) is False


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"eviction_policy": "lruu"}, "kv_connector_extra_config['eviction_policy']: unknown eviction policy 'lruu'"),
        ({"cpu_bytes_to_use": "8 parsecs"}, "kv_connector_extra_config['cpu_bytes_to_use']"),
        ({"disk_bytes_to_use": "1GiB"}, "kv_connector_extra_config['disk_bytes_to_use']: needs disk_root"),
        ({"spec_name": "CPUOffloadingSpec"}, "kv_connector_extra_config['spec_name']: 'CPUOffloadingSpec'"),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_key(change, names):
    with pytest.raises(InvalidArgumentError) as e:
        KvtierConnector.requires_piecewise_for_cudagraph({**EXTRA, **change})
    assert str(e.value).startswith(names), str(e.value)


def test_tiers_whose_series_exist_from_start_up():
    assert m.exported_tiers(EXTRA) == ("cpu",)
    assert m.exported_tiers({**EXTRA, "disk_root": "/d"}) == ("cpu", "disk")
    tiering = {"spec_name": "KvtierTieringOffloadingSpec", "secondary_tiers": [{"type": "KvtierDiskTier"}]}
    assert m.exported_tiers(tiering) == ("disk",)
    assert m.exported_tiers({**tiering, "secondary_tiers": [{"type": "fs"}]}) == ()
    remote = [{"type": "KvtierRemoteTier"}, {"type": "KvtierDiskTier"}]
    assert m.exported_tiers({**tiering, "secondary_tiers": remote}) == ("disk", "remote")
    assert m.exported_tiers({**tiering, "secondary_tiers": remote[:1]}) == ("remote",)


def test_only_label_values_known_up_front_are_created():
    tiers = ("cpu", "disk")
    assert _known_label_values(m.PREFIX + "loads_cpu", (), tiers) == [()]
    assert _known_label_values(m.PREFIX + "evictions", ("tier",), tiers) == [("cpu",), ("disk",)]
    # Dropped write-throughs: each lower tier (the CPU tier has none) and every reason.
    drops = _known_label_values(m.PREFIX + m.WRITE_DROPS, ("tier", "reason"), tiers)
    assert drops == [("disk", r) for r in m.WRITE_DROP_REASONS]
    # vLLM's tiering spec labels its own series by its tiers' names, which kvtier does not know.
    assert _known_label_values("vllm:kv_offload_tier_lookup_sync_delay_seconds", ("tier",), tiers) == []
