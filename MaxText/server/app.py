"""The OpenAI-compatible app (`create_app`) over a started engine and its tokenizer: the routes, the API key, the
error handlers and /health."""

import contextlib
import hmac

import fastapi
import starlette.exceptions

from MaxText import chat_template
from MaxText.common_types import Config, ConfigError
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.server import chat, completions, info
from MaxText.server.options import Options
from MaxText.server.protocol import APIError, error_response, validation_error
from MaxText.server.service import Server


def _add_error_handlers(app: fastapi.FastAPI) -> None:
  async def api_error(request, error: APIError):
    return error_response(error)

  async def http_error(request, error: starlette.exceptions.HTTPException):
    code = "not_found" if error.status_code == 404 else None
    return error_response(APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=code))

  async def request_validation_error(request, error: fastapi.exceptions.RequestValidationError):
    first = dict(error.errors()[0])
    first["loc"] = tuple(first["loc"])[1:]  # ("body", field, ...)
    return error_response(validation_error(first))

  async def internal_error(request, error: Exception):
    return error_response(APIError(500, f"internal error ({type(error).__name__}); the server logged it"))

  app.add_exception_handler(APIError, api_error)
  app.add_exception_handler(starlette.exceptions.HTTPException, http_error)
  app.add_exception_handler(fastapi.exceptions.RequestValidationError, request_validation_error)
  app.add_exception_handler(Exception, internal_error)


def create_app(engine, tokenizer: tokenizer_lib.Tokenizer, config_or_options: Config | Options) -> fastapi.FastAPI:
  """The OpenAI-compatible app over a started `engine` (inference/engine.py's interface) and its tokenizer."""
  options = config_or_options if isinstance(config_or_options, Options) else Options.from_config(config_or_options)
  try:
    template = chat_template.compile_template(options.chat_template)
  except ConfigError as e:
    raise ConfigError(f"chat template: {e}") from None
  server = Server(engine, tokenizer, options, template)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    server.stopping = True
    server.workers.shutdown(wait=False, cancel_futures=True)

  def authorize(request: fastapi.Request) -> None:
    if not options.api_key:
      return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), options.api_key.encode()):
      raise APIError(401, "missing or wrong API key; send `Authorization: Bearer KEY`", code="invalid_api_key")

  app = fastapi.FastAPI(title="MaxText", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
  app.state.server = server
  _add_error_handlers(app)
  api = fastapi.APIRouter(dependencies=[fastapi.Depends(authorize)])

  @api.post("/v1/completions")
  async def post_completions(request: fastapi.Request):
    return await completions.completions(server, request)

  @api.post("/v1/chat/completions")
  async def post_chat_completions(request: fastapi.Request):
    return await chat.chat_completions(server, request)

  info.add_routes(api, server)
  app.include_router(api)

  @app.get("/health")
  async def health():  # On the event loop itself: it answers while workers are busy.
    running = getattr(engine, "running", None)  # Engine.running(): its scheduling thread is alive.
    if server.stopping or (callable(running) and not running()):
      raise APIError(503, "the engine is not running", code="engine_stopped")
    return {}

  return app
