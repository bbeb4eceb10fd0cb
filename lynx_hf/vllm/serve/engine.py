"""One vLLM engine in a process of its own, driven over a pipe: add, abort, step outputs with their wall-clock
times, the block pool's free count and the spec-decode counters. The orchestrator (pd.py) runs a prefill and a
decode engine this way, so each has its own process and threads, as two serving nodes would.

The engine runs in-process inside its child (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler, connector and worker in
one process), so the block pool is readable; the child steps the engine while it has unfinished requests (sleeping
1 ms on a step with no output, e.g. while requests wait for their KV) and blocks on the pipe otherwise."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
             "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


class EngineFailed(RuntimeError):
    """The engine process failed to start or died."""


@dataclass
class Event:
    """New tokens of one request (times are time.time(), comparable across processes)."""
    rid: str
    tokens: list
    t: float
    finished: bool = False
    finish_reason: str | None = None
    kv_params: dict | None = None
    extra: dict = field(default_factory=dict)


SPEC_COUNTERS = {"vllm:spec_decode_num_draft_tokens": "draft", "vllm:spec_decode_num_accepted_tokens": "accepted"}


def _counters(engine) -> dict:
    """vLLM's spec-decode counters: draft tokens proposed to and accepted by its rejection sampler, so far."""
    out = {"draft": 0, "accepted": 0}
    for m in engine.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(getattr(m, "value", 0))
    return out


def _free_blocks(engine) -> int:
    return engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def disjoint_cores() -> tuple[list, list] | None:
    """This process's cores split in two (prefill, decode), as two serving nodes have their own; None below two."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def _child(conn, engine_kwargs: dict, env: dict, cores: list | None) -> None:
    os.environ.update(env)
    if cores:  # before torch starts its threads: the engine (and its OpenMP pool) runs on these cores only
        os.sched_setaffinity(0, cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
    os.dup2(2, 1)  # vLLM logs to stdout: keep the driver's stdout (a table, a JSON line) its own
    try:
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.inputs import tokens_input

        engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs))
        import vllm

        conn.send(("ready", vllm.__version__, _free_blocks(engine)))
    except BaseException:  # noqa: BLE001 — reported to the parent, which raises
        conn.send(("error", traceback.format_exc()[-4000:]))
        return
    sent: dict[str, int] = {}
    while True:
        busy = engine.has_unfinished_requests()
        while conn.poll(0 if busy else None):
            cmd, *args = conn.recv()
            if cmd == "add":
                rid, ids, sp, salt = args
                try:
                    prompt = tokens_input(ids, cache_salt=salt) if salt else tokens_input(ids)
                    engine.add_request(rid, prompt, SamplingParams(**sp))
                    sent[rid] = 0
                except Exception as e:  # noqa: BLE001 — a refused request fails alone
                    conn.send(("out", rid, [], time.time(), True, "refused", None, {"error": str(e)[:500]}))
            elif cmd == "abort":
                engine.abort_request(args[0])
                for rid in args[0]:
                    sent.pop(rid, None)
            elif cmd == "free":
                conn.send(("free", _free_blocks(engine)))
            elif cmd == "counters":
                conn.send(("counters", _counters(engine)))
            elif cmd == "reset":
                conn.send(("reset", bool(engine.reset_prefix_cache())))
            elif cmd == "stop":
                return
            busy = engine.has_unfinished_requests()
        if not busy:
            continue
        outs = engine.step()
        now = time.time()
        for o in outs:
            if o.request_id not in sent:
                continue
            toks = list(o.outputs[0].token_ids)
            conn.send(("out", o.request_id, toks[sent[o.request_id]:], now, o.finished, o.outputs[0].finish_reason,
                       o.kv_transfer_params, {}))
            sent[o.request_id] = len(toks)
            if o.finished:
                del sent[o.request_id]
        if not outs:
            time.sleep(0.001)


class EngineProcess:
    """A vLLM engine in a spawned process. `start()` waits for it (minutes on a busy machine: `start_timeout_s`)."""

    def __init__(self, engine_kwargs: dict, env: dict | None = None, name: str = "engine", cores: list | None = None):
        """cores: the CPU ids the engine's process may run on (None: all of this process's)."""
        self.name, self.kwargs, self.env = name, engine_kwargs, {**CHILD_ENV, **(env or {})}
        self.cores = list(cores) if cores else None
        self.version = None
        self._events: dict[str, queue.Queue] = {}
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()      # the event queues
        self._ask_lock = threading.Lock()  # one question at a time: replies come back in order
        self._send_lock = threading.Lock()
        self._proc = None

    def start(self, start_timeout_s: float = 600.0) -> "EngineProcess":
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, self.kwargs, self.env, self.cores),
                                 name=f"lynx-{self.name}", daemon=True)
        self._proc.start()
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise EngineFailed(f"{self.name}: the vLLM engine did not start within {start_timeout_s:g} s")
        msg = self._conn.recv()
        if msg[0] != "ready":
            self.close()
            raise EngineFailed(f"{self.name}: the vLLM engine failed to start:\n{msg[1]}")
        self.version, self.initial_free_blocks = msg[1], msg[2]
        threading.Thread(target=self._read, name=f"lynx-{self.name}-reader", daemon=True).start()
        return self

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                for q in list(self._events.values()):
                    q.put(None)
                self._replies.put(None)
                return
            if msg[0] == "out":
                rid, toks, t, fin, reason, kv, extra = msg[1:]
                with self._lock:
                    q = self._events.get(rid)
                if q is not None:
                    q.put(Event(rid, toks, t, fin, reason, kv, extra))
            else:
                self._replies.put(msg)

    def add(self, rid: str, ids: list, sampling: dict, cache_salt: str | None = None) -> "queue.Queue[Event]":
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._events[rid] = q
        self._send(("add", rid, list(ids), sampling, cache_salt))
        return q

    def _send(self, msg) -> None:
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (OSError, BrokenPipeError) as e:
                raise EngineFailed(f"{self.name}: the engine process is gone ({e})") from None

    def forget(self, rid: str) -> None:
        with self._lock:
            self._events.pop(rid, None)

    def abort(self, rids: list) -> None:
        self._send(("abort", list(rids)))
        for r in rids:
            self.forget(r)

    def _ask(self, what: str, timeout_s: float = 30.0):
        with self._ask_lock:
            self._send((what,))
            msg = self._replies.get(timeout=timeout_s)
        if msg is None:
            raise EngineFailed(f"{self.name}: the engine process is gone")
        return msg[1]

    def free_blocks(self) -> int:
        return self._ask("free")

    def counters(self) -> dict:
        return self._ask("counters")

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's reset_prefix_cache; False while requests still hold blocks)."""
        return self._ask("reset")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("stop",))
        except (OSError, BrokenPipeError):
            pass
        self._proc.join(20)
        if self._proc.is_alive():
            self._proc.kill()
        self._proc = None
