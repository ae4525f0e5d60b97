"""Serving a config: bind first (a taken port fails before the checkpoint loads), load the engine, compile its
programs (saying how far it got), then uvicorn with a deadline for each request's headers, until SIGINT or SIGTERM.
MaxText/serve.py is its command line."""

import contextlib
import signal
import socket
import sys
import threading
import time

import fastapi
import h11
import jax
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from MaxText import cli
from MaxText.common_types import Config, ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.inference.request import counted
from MaxText.server.app import create_app
from MaxText.server.options import Options

PROGRESS_SECONDS = 5  # start-up: a line at least this often while the engine's programs compile


def listen(host: str, port: int) -> socket.socket:
  """A listening socket on host:port; ConfigError (one line) when the address is taken or not this machine's."""
  try:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
  except OSError as e:
    raise ConfigError(
      f"server_host={host} server_port={port}: cannot listen there ({e.strerror or e}); pick another port or host"
    ) from None
  sock.listen(2048)
  return sock


def compile_programs(engine) -> None:
  """engine.warmup(), saying what it compiles and how far it got (a line at least every PROGRESS_SECONDS), since
  the first request may only come after it: every prefill size and generate shape compiled now, so that no
  request waits for a compile."""
  programs = engine.programs()
  prefill = sum(program.name == "prefill" for program in programs)
  cli.log(
    f"Compiling the engine's programs before serving: {counted(prefill, 'prefill size')} and "
    f"{counted(len(programs) - prefill, 'generate shape')} (rows x pages read), {counted(len(programs), 'program')}"
  )
  start = last = time.perf_counter()

  def progress(i: int, program) -> None:
    nonlocal last
    now = time.perf_counter()
    if now - last >= PROGRESS_SECONDS or i == len(programs):
      cli.log(f"  compiled {i}/{len(programs)} ({program}), {now - start:.1f} s so far")
      last = now

  engine.warmup(progress)
  cli.log(f"Compiled the engine's programs in {engine.stats['compile_seconds']:.1f} s")


class TimedH11Protocol(H11Protocol):
  """uvicorn's HTTP/1.1 protocol (h11), with a deadline for each request's headers: uvicorn's only timeout is for
  an idle kept-alive connection, so a client that sends its headers a byte at a time (or nothing after connecting)
  held its socket forever. `read_timeout` seconds after a connection opens or a response ends, a connection whose
  next request the app has not received is answered 408 and closed (the app bounds reading the body itself,
  read_body). Subclassed by `uvicorn_config` with the value."""

  read_timeout = 30.0

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self._deadline = None
    self._arm()

  def handle_events(self) -> None:
    super().handle_events()
    if self._app_has_it() and self._deadline is not None:
      self._deadline.cancel()
      self._deadline = None

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._arm()

  def connection_lost(self, exc) -> None:
    if self._deadline is not None:
      self._deadline.cancel()
      self._deadline = None
    super().connection_lost(exc)

  def _app_has_it(self) -> bool:
    return self.cycle is not None and not self.cycle.response_complete

  def _arm(self) -> None:
    if self._deadline is not None:
      self._deadline.cancel()
    closing = self.transport.is_closing()
    self._deadline = None if closing else self.loop.call_later(self.read_timeout, self._expire)

  def _expire(self) -> None:
    self._deadline = None
    if self._app_has_it() or self.transport.is_closing():
      return
    if self.conn.their_state is h11.IDLE:  # its headers did not come (else: the rest of a body already answered)
      self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    self.transport.close()


def uvicorn_config(app: fastapi.FastAPI, **kw) -> uvicorn.Config:
  """uvicorn's config for an app of create_app: TimedH11Protocol with its options' read_timeout."""
  seconds = app.state.server.options.read_timeout
  protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": seconds})
  return uvicorn.Config(app, http=protocol, **kw)


def serve(config: Config) -> int:
  """Binds first (a taken port fails before the checkpoint loads), then loads the engine and serves until SIGINT or
  SIGTERM; the engine stops as the server does."""
  options = Options.from_config(config)
  if jax.process_count() > 1:
    raise ConfigError(
      f"serve.py runs in one process (this job has {jax.process_count()}): its scheduler and HTTP server are one "
      "process's; serve on one host's devices"
    )
  sock = listen(config.server_host, config.server_port)
  loopback = config.server_host in ("127.0.0.1", "localhost", "::1")
  if not loopback and not options.api_key:
    print(
      f"warning: server_host={config.server_host} with no server_api_key: anyone who reaches it can use it", file=sys.stderr
    )
  cli.log(f"Loading the model and its parameters ({config.load_parameters_path or 'the latest checkpoint of run_name'})")
  engine, tokenizer = engine_lib.Engine.from_config(config, max_queue=config.server_max_queue)
  cli.log(f"Parameters from {engine.loaded_from}")
  app = create_app(engine, tokenizer, options)
  compile_programs(engine)
  engine.start()
  try:
    host, port = sock.getsockname()[:2]
    cli.log(f"Serving {options.model_name!r} at http://{host}:{port}/v1 (GET /health, /v1/models)")
    # SIGINT or SIGTERM: new connections are refused, and streams still open after 5 s are cut (their requests then
    # end as engine.stop() aborts them).
    with _stop_signals_end_quietly():
      uvicorn.Server(uvicorn_config(app, log_level="info", timeout_graceful_shutdown=5)).run(sockets=[sock])
  finally:
    engine.stop()
    sock.close()
  cli.log("Stopped")
  return 0


@contextlib.contextmanager
def _stop_signals_end_quietly():
  """uvicorn stops on SIGINT or SIGTERM, then raises the signal again for the handler it found: with these no-op
  handlers that second raise does nothing, so a stopped server exits 0 (after engine.stop) instead of as killed."""
  if threading.current_thread() is not threading.main_thread():  # Python delivers signals to the main thread only.
    yield
    return
  previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
