"""`LynxConnector`: lynx-hf's KV transfer as a vLLM v1 KV connector, loaded out of tree:

    kv_transfer_config={"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_hf.vllm.connector",
                        "kv_role": "kv_producer" | "kv_consumer",
                        "kv_connector_extra_config": {"port": 7411, "bandwidth_mbps": 15, ...}}

Each hook adapts vLLM's objects to the plain-data twin in hooks.py (the logic lives there, tested without vLLM).
Extra config: `host`/`port` the prefill instance's KV stream listens on; `bandwidth_mbps`, `latency_ms` its
emulated link; `max_held_mb` the encoded KV it may hold; `timeout_s` how long the decode side waits for a frame;
`quant` the codec's fields other than its method (both instances must agree); `secret` or $LYNX_SECRET, or
`insecure: true` on loopback only. Runs on vLLM's CPU backend (vec/vec16 attention kernels: their paged layout is
the one paged.py reads)."""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata)

from ..transfer.auth import resolve_secret
from .hooks import SchedulerSide, StepMeta, WorkerSide
from .stream import KVPublisher

log = logging.getLogger("lynx_hf.vllm")


@dataclass
class LynxStepMetadata(KVConnectorMetadata):
    step: StepMeta


@dataclass
class LynxWorkerMetadata(KVConnectorWorkerMetadata):
    stats: dict  # req_id -> {"bytes", "anchor_bytes", "anchor_at", "full_at"}

    def aggregate(self, other: "LynxWorkerMetadata") -> "LynxWorkerMetadata":
        return LynxWorkerMetadata({**self.stats, **other.stats})


def model_fingerprint(vllm_config) -> str:
    """What both instances must share: the model's architecture and shapes, and the KV dtype."""
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict()
    keep = {k: hf.get(k) for k in ("architectures", "model_type", "num_hidden_layers", "hidden_size",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                   "rope_theta", "rope_parameters", "max_position_embeddings")}
    keep["dtype"] = str(mc.dtype)
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()


def _layer_order(name: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", name)) or (0,)


class LynxConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.kv_role = ktc.kv_role
        self._sched = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.kv_role)
            return
        host = str(extra.get("host", "127.0.0.1"))
        secret = resolve_secret(extra.get("secret"), bool(extra.get("insecure", False)), host)
        publisher = None
        if self.kv_role in ("kv_producer", "kv_both"):
            bw = extra.get("bandwidth_mbps")
            publisher = KVPublisher(host, int(extra.get("port", 7411)), secret, model_fingerprint(vllm_config),
                                    bandwidth_bps=None if bw in (None, 0) else float(bw) * 1e6,
                                    latency_s=float(extra.get("latency_ms", 0)) / 1e3,
                                    max_bytes=int(float(extra.get("max_held_mb", 1024)) * (1 << 20)))
            log.info("Lynx KV stream on %s:%d (link %s Mbit/s)", host, publisher.port, bw or "unpaced")
        self._worker = WorkerSide(dict(extra.get("quant", {})), secret, model_fingerprint(vllm_config), publisher,
                                  float(extra.get("timeout_s", 60)), bool(extra.get("upgrade_shadows", True)))

    # ---- worker side ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        first = next(iter(kv_caches.values()))
        isa = _get_attn_isa(first.dtype, first.shape[2], first.shape[3] // 2)
        if isa not in ("vec", "vec16"):
            raise RuntimeError(f"LynxConnector reads vLLM's CPU paged KV of the vec/vec16 kernels; this machine "
                               f"runs {isa!r}, whose block layout is not the one lynx_hf.vllm.paged reads")
        self._worker.register(dict(sorted(kv_caches.items(), key=lambda kv: _layer_order(kv[0]))))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self.has_connector_metadata():
            self._worker.begin_step(self._get_connector_metadata().step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its tier is in

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        if self.has_connector_metadata():
            self._worker.save_layer(self._get_connector_metadata().step, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        return  # save_kv_layer encoded and queued each layer; the publisher streams it

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self):
        stats = self._worker.stats()
        return LynxWorkerMetadata(stats) if stats else None

    def drafting(self) -> dict:
        """Live transfers with a shadow (xfer → (prompt length, prompt digest)): what LynxProposer drafts for."""
        return dict(self._worker.drafting) if self._worker is not None else {}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._sched.matched(request.request_id, list(request.prompt_token_ids or []),
                                   request.kv_transfer_params, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.allocated(request.request_id, list(request.prompt_token_ids or []), request.kv_transfer_params,
                              blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        cached = [(rid, None if c.new_block_ids[i] is None else c.new_block_ids[i][0], c.num_computed_tokens[i])
                  for i, rid in enumerate(c.req_ids)]
        return LynxStepMetadata(self._sched.step_meta(new, cached, dict(scheduler_output.num_scheduled_tokens)))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, LynxWorkerMetadata):
            self._sched.worker_meta(meta.stats)

    def request_finished(self, request, block_ids: list[int]):
        return False, self._sched.finished(request.request_id, request.kv_transfer_params)
