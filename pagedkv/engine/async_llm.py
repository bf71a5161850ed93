"""`AsyncLLM`: the engine stepping on a background thread, streaming outputs to asyncio callers.

Callers (the server's request handlers) validate a request on their own thread, then hand it over
through a command queue; the engine thread applies commands at step boundaries (add, abort), runs
`step()`, and posts each output to its request's asyncio queue. A caller that stops listening (a
client that disconnects) aborts its request, which frees its blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("pagedkv.engine")


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self.stats = engine.stats()  # a snapshot, replaced (never mutated) by the engine thread
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, stream: bool = True) -> "RequestStream":
        """Queue a request; iterate the returned stream for its outputs (with `stream=False`, only the last).

        Raises ConfigError / ContextWindowError, with nothing queued, when the request is invalid. Call
        from a running event loop; closing the stream before it finishes aborts the request.
        """
        seq = self.engine.make_sequence(prompt, params, request_id=request_id, stream=stream)
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[seq.request_id] = (asyncio.get_running_loop(), out_queue)
        self._command("add", seq)
        return RequestStream(self, seq.request_id, out_queue)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """`add_request`, then its outputs; leaving the iteration early (or being cancelled) aborts it."""
        request = self.add_request(prompt, params, request_id=request_id, stream=stream)
        try:
            async for out in request:
                yield out
        finally:
            request.close()

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._command("abort", request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------
    # the engine thread
    def _command(self, kind: str, arg) -> None:
        self._commands.put((kind, arg))
        self._wakeup.set()

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add(arg)
                except Exception as exc:  # e.g. a duplicate request id
                    arg.error = str(exc)
                    arg.finish("error")
                    self._deliver(arg.output(""))
            else:
                self.engine.abort(arg)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
        if entry is None:
            return
        loop, out_queue = entry
        try:
            loop.call_soon_threadsafe(out_queue.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            self.abort(out.request_id)

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self.stats = self.engine.stats()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug in scheduling: fail what is in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                outputs = [o for rid in list(self.engine.requests) if (o := self.engine.abort(rid)) is not None]
                for out in outputs:
                    out.outputs[0].finish_reason, out.error = "error", "internal error in the engine step"
            for out in outputs:
                self._deliver(out)
            self.stats = self.engine.stats()


class RequestStream:
    """The outputs of one queued request, as an async iterator."""

    def __init__(self, llm: AsyncLLM, request_id: str, out_queue: asyncio.Queue):
        self.llm = llm
        self.request_id = request_id
        self.queue = out_queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        self.finished = out.finished
        return out

    def close(self) -> None:
        """Stop listening; a request still running is aborted and its blocks freed."""
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)
