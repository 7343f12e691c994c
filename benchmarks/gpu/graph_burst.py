"""A copy burst as one CUDA graph launch: the experiment behind ``copy_thread_cost.py``'s ``inline_graph`` variants.

Why: on D-dense the runtime's host time is the cost of offloading (session 29: ours' overhead grows with a slower
host CPU), and most of it is CUDA calls, about eleven per layer and microbatch at 15-20 µs each inside a step. A burst
now costs a fence record, a wait, one ``cudaMemcpyAsync`` per storage and a done record. A graph of the burst's
copies, instantiated once, needs per burst only ``cudaGraphExecMemcpyNodeSetParams1D`` for each copy (host-side
bookkeeping, no submission to the GPU) and one ``cudaGraphLaunch``; with ``with_events`` the side stream's wait on
the fence and its done record are graph nodes too (external event nodes, their events set per launch). Whether
that is cheaper in host time is what the variants measure; nothing in the runtime uses it.

GPU host, torch only; built by stream capture on the side stream (relaxed mode, so other threads are not affected).
"""

from __future__ import annotations

import ctypes
from typing import Any

CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
EVENT_RECORD_EXTERNAL = 1  # cudaEventRecordExternal: a record captured as an event-record node
EVENT_WAIT_EXTERNAL = 1  # cudaEventWaitExternal: a wait captured as an event-wait node
NODE_MEMCPY, NODE_WAIT_EVENT, NODE_EVENT_RECORD = 1, 6, 7  # cudaGraphNodeType


class GraphRuntime:
    """The graph entry points of the CUDA runtime that :class:`~mcore_offload.runtime.cudart.CudaRuntime` wraps."""

    def __init__(self, rt: Any) -> None:
        lib, vp, u, sz = rt._lib, ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        self.rt = rt

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            return fn

        self.begin_capture = bind("cudaStreamBeginCapture", vp, ctypes.c_int)
        self.end_capture = bind("cudaStreamEndCapture", vp, ctypes.POINTER(vp))
        self.instantiate = bind("cudaGraphInstantiate", ctypes.POINTER(vp), vp, ctypes.c_ulonglong)
        self.get_nodes = bind("cudaGraphGetNodes", vp, ctypes.POINTER(vp), ctypes.POINTER(sz))
        self.node_type = bind("cudaGraphNodeGetType", vp, ctypes.POINTER(ctypes.c_int))
        self.set_copy = bind("cudaGraphExecMemcpyNodeSetParams1D", vp, vp, vp, vp, sz, ctypes.c_int)
        self.set_record_event = bind("cudaGraphExecEventRecordNodeSetEvent", vp, vp, vp)
        self.set_wait_event = bind("cudaGraphExecEventWaitNodeSetEvent", vp, vp, vp)
        self.launch = bind("cudaGraphLaunch", vp, vp)
        self.record_with_flags = bind("cudaEventRecordWithFlags", vp, vp, u)

    def check(self, what: str, err: int) -> None:
        if err:
            self.rt.fail(what, err)


class GraphBurst:
    """``count`` copies of one direction on ``stream`` as an instantiated graph; :meth:`launch` gives them this
    burst's addresses and launches it."""

    def __init__(self, g: GraphRuntime, stream: int, count: int, kind: int, with_events: bool) -> None:
        import torch

        self.g, self.stream, self.kind, self.with_events = g, stream, kind, with_events
        rt = g.rt
        # capture-time placeholders of the same memory kinds as every later burst's (device and pinned host)
        self._dev = torch.empty(count * 512, dtype=torch.uint8, device="cuda")
        self._host = torch.empty(count * 512, dtype=torch.uint8, pin_memory=True)
        dev, host = self._dev.data_ptr(), self._host.data_ptr()
        ev = ctypes.c_void_p()
        g.check("cudaEventCreateWithFlags", rt.event_create(ctypes.byref(ev), 2))
        self._placeholder_event = ev.value
        g.check("cudaStreamBeginCapture", g.begin_capture(stream, CAPTURE_MODE_RELAXED))
        if with_events:
            g.check("cudaStreamWaitEvent (capture)", rt.stream_wait(stream, ev.value, EVENT_WAIT_EXTERNAL))
        for i in range(count):
            dst, src = (host, dev) if kind == 2 else (dev, host)
            g.check("cudaMemcpyAsync (capture)", rt.memcpy(dst + 512 * i, src + 512 * i, 512, kind, stream))
        if with_events:
            g.check("cudaEventRecordWithFlags (capture)", g.record_with_flags(ev.value, stream, EVENT_RECORD_EXTERNAL))
        graph = ctypes.c_void_p()
        g.check("cudaStreamEndCapture", g.end_capture(stream, ctypes.byref(graph)))
        n = ctypes.c_size_t(0)
        g.check("cudaGraphGetNodes", g.get_nodes(graph, None, ctypes.byref(n)))
        nodes = (ctypes.c_void_p * n.value)()
        g.check("cudaGraphGetNodes", g.get_nodes(graph, nodes, ctypes.byref(n)))
        self.copies, self.wait_node, self.record_node = [], None, None
        for node in nodes:
            t = ctypes.c_int(0)
            g.check("cudaGraphNodeGetType", g.node_type(node, ctypes.byref(t)))
            if t.value == NODE_MEMCPY:
                self.copies.append(node)
            elif t.value == NODE_WAIT_EVENT:
                self.wait_node = node
            elif t.value == NODE_EVENT_RECORD:
                self.record_node = node
        if len(self.copies) != count or with_events and (self.wait_node is None or self.record_node is None):
            raise RuntimeError(f"captured graph has {len(self.copies)} copy nodes of {count}, wait node "
                               f"{self.wait_node is not None}, record node {self.record_node is not None}")
        exe = ctypes.c_void_p()
        g.check("cudaGraphInstantiate", g.instantiate(ctypes.byref(exe), graph, 0))
        self.exec = exe.value
        self._graph = graph.value

    def launch(self, dsts: list[int], srcs: list[int], nbytes: int, wait_event: int | None = None,
               done_event: int | None = None) -> None:
        g, exe, kind = self.g, self.exec, self.kind
        set_copy = g.set_copy
        for node, dst, src in zip(self.copies, dsts, srcs):
            err = set_copy(exe, node, dst, src, nbytes, kind)
            if err:
                g.check("cudaGraphExecMemcpyNodeSetParams1D", err)
        if self.with_events:
            g.check("cudaGraphExecEventWaitNodeSetEvent", g.set_wait_event(exe, self.wait_node, wait_event))
            g.check("cudaGraphExecEventRecordNodeSetEvent", g.set_record_event(exe, self.record_node, done_event))
        err = g.launch(exe, self.stream)
        if err:
            g.check("cudaGraphLaunch", err)
