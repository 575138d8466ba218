"""``embedingest serve``: an index kept open behind a small HTTP server (FastAPI on uvicorn).

Needs the ``serve`` extra (``pip install 'embedingest[serve]'``).
"""

from __future__ import annotations

import contextlib

import ipaddress
import logging
import os
import socket

from ..errors import ConfigError

log = logging.getLogger("embedingest")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: a free port), as uvicorn binds one, made
    here so that a port in use is an error naming it before anything says the index is
    served, and so that the address printed is the one bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r}: no such address here ({exc}); give an address of "
                          f"this machine, e.g. 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections wait in its queue until the server accepts them
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose "
                          f"another --port (0 picks a free one) or stop what uses it") from None
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op threads set to ``threads`` (None: left) for the block, and set back
    after it: a notebook that served (or failed to) ran its later torch work on one thread."""
    if threads is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def serve(index_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000, *, device: str = "cpu",
          params: str | None = None, query_prompt: str | None = None, max_query_chars: int | None = None,
          max_k: int | None = None, threads: int | None = 1, on_ready=None,
          cache_dir: str | os.PathLike | None = None, cache_size: float | None = None,
          query_runtime: str = "auto") -> None:
    """Open ``index_dir``, load its model, and serve it until interrupted; a local index
    that a build changes meanwhile is opened again (:mod:`.live`).

    ``params`` and ``query_prompt`` as for :func:`~embedingest.open_index` (None: the
    index's own). ``threads``: torch threads of the query encoder (None: torch's default,
    every core); one query of a few words gains little from more, and they wait on each
    other as soon as the cores are busy with anything else. ``on_ready(url)`` is called
    once the model is loaded and the port bound (a port in use is a :class:`ConfigError`
    naming it; port 0 takes a free one, which the URL names). ``index_dir`` may be an
    index in object storage (``s3://...``), read through ``cache_dir`` of ``cache_size`` GiB (see
    :func:`~embedingest.open_index`). ``query_runtime``: what encodes the queries
    (:mod:`~embedingest.stages.query_runtime`); ONNX Runtime gets ``threads`` threads too.
    """
    try:
        import uvicorn

        from .app import MAX_K, MAX_QUERY_CHARS, create_app
    except ImportError as exc:
        raise ConfigError(f"serve needs FastAPI and uvicorn ({exc}); install them with "
                          f"pip install 'embedingest[serve]'") from exc
    from ..index.search import open_index
    from ..sources.remote import is_remote
    from .live import LiveIndex

    with torch_threads(threads):  # the caller's setting is back once serving ends, or fails
        def opened(encoder=None):
            return open_index(index_dir, device=device, params=params, query_prompt=query_prompt,
                              cache_dir=cache_dir, cache_size=cache_size, query_runtime=query_runtime,
                              encoder=encoder)

        index = opened()
        # a local index is opened again once a build changed it (object storage: as opened)
        live = LiveIndex(index, None if is_remote(str(index_dir)) else opened, folder=index_dir)
        try:
            index.search(["warm up the model"], k=1)  # load it now, not at the first request
            app = create_app(live, max_query_chars=max_query_chars or MAX_QUERY_CHARS, max_k=max_k or MAX_K)
            if not is_loopback(host):
                log.warning("serving on %s: every machine that reaches it can query the index and "
                            "read the corpus files it names", host)
            sock = listening_socket(host, port)
            try:
                port = sock.getsockname()[1]
                if on_ready is not None:
                    on_ready(f"http://{host if ':' not in host else f'[{host}]'}:{port}/")
                # no lifespan task (the app has no start-up or shut-down hooks): a second Ctrl-C
                # cancelled it mid-stop, and starlette printed the CancelledError's traceback
                config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
                uvicorn.Server(config).run(sockets=[sock])
            finally:
                sock.close()
        finally:
            live.close()
