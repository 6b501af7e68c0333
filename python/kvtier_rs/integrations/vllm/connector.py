"""``KvtierConnector``: vLLM's ``OffloadingConnector`` with kvtier's start-up behaviour.

Load it with ``"kv_connector": "KvtierConnector", "kv_connector_module_path":
"kvtier_rs.integrations.vllm"``; the extra config (``spec_name`` and the rest) is the same as
under ``OffloadingConnector``, and the data path is vLLM's connector's, unchanged. What it adds:

* **Every offload series in /metrics from start-up.** prometheus_client shows a labelled series
  only once a value has reached it, and the engine sends connector stats only after a step: under
  ``OffloadingConnector`` kvtier's series, and vLLM's own ``vllm:kv_offload_*``, appear after the
  first request, so an alert on them cannot tell "no traffic" from "not configured". The API
  server builds the connector's Prometheus metrics before it serves /metrics; here every series
  whose label values are known up front is created there, at zero.
* **Requests' TTFT and ITL for the request SLO rule** (``slo_guard``): the scheduler-side
  connector sees each request arrive (``get_num_new_matched_tokens``), sees its first token at
  the next step it schedules (``build_connector_meta``), and sees it finish. Its time to first
  token (from the request's arrival, as the API server stamped it) and its mean inter-token
  latency go to the manager's ``RequestGuard``. Under ``OffloadingConnector`` nothing measures
  requests, so ``kvtier vllm-config`` refuses ``slo_guard`` there and the engine logs it.
* **The configuration checked in the API server's process**, where vLLM first hands it to the
  connector class (``requires_piecewise_for_cudagraph``, asked while vLLM builds its config when
  CUDA graphs are on), before any engine process starts or a model loads. Without CUDA graphs
  (vLLM's CPU platform, ``--enforce-eager``) vLLM asks the class nothing with the configuration
  before the engine builds the spec; ``kvtier vllm-config`` checks it beforehand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.config_check import check_extra
from kvtier_rs.integrations.vllm.timings import RequestTimings


class KvtierPromMetrics(OffloadPromMetrics):
    """vLLM's offload metrics, with every series whose labels are known created at zero."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        tiers = m.exported_tiers(extra)
        for engine_idx in per_engine_labelvalues:
            for name, metadata in self._offloading_metric_metadata.items():
                for labelvalues in _known_label_values(name, metadata.labelnames, tiers):
                    # Creates the labelled series (at zero) and caches it for observe().
                    self._get_prometheus_metric(name, labelvalues, engine_idx)


def _known_label_values(name: str, labelnames: tuple[str, ...], tiers: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The label-value tuples a metric will be reported with, where they are known before any
    report: none for an unlabelled metric, each of kvtier's tiers for kvtier's per-tier ones,
    each lower tier and reason for the dropped write-throughs; other labelled metrics (vLLM's
    tiering spec labels its own by tier too) wait for their first report."""
    if not labelnames:
        return [()]
    if name.startswith(m.PREFIX) and tuple(labelnames) == ("tier",):
        return [(t,) for t in tiers]
    if name == m.PREFIX + m.WRITE_DROPS:
        return list(m.write_drop_labels(tiers))
    return []


class KvtierConnector(OffloadingConnector):
    """``OffloadingConnector`` whose metrics exist from start-up, whose configuration is
    checked before the engine starts where vLLM allows it, and which measures requests for the
    request SLO rule (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        guard = None
        if self.connector_scheduler is not None:
            guard = getattr(self.connector_scheduler.manager, "request_guard", None)
        self._timings = None if guard is None else RequestTimings(guard)
        if guard is not None:
            self.connector_scheduler.manager.request_timings = True  # type: ignore[union-attr]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._timings is not None:
            self._timings.arrived(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._timings is not None:
            self._timings.step()
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._timings is not None:
            self._timings.finished(request)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._timings is not None:
            self._timings.finished(request)
        return super().request_finished_all_groups(request, block_ids)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        check_extra(_as_mapping(extra_config))
        return bool(super().requires_piecewise_for_cudagraph(extra_config))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _as_mapping(extra_config: Any) -> Mapping[str, Any]:
    return extra_config if isinstance(extra_config, Mapping) else {}
