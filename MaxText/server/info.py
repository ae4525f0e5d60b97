"""The routes about the model and its tokenizer: GET /v1/models and /tokenizer_info, POST /tokenize and /detokenize
(vLLM's, which lm-eval's tokenizer_backend=remote uses to count tokens)."""

import json
import time

import fastapi
from fastapi import responses

from MaxText.server.protocol import DetokenizeBody, TokenizeBody, check_ids
from MaxText.server.service import Server


def add_routes(api: fastapi.APIRouter, server: Server) -> None:
  created = int(time.time())
  tokenizer, options = server.tokenizer, server.options

  @api.get("/v1/models")
  def models():
    card = {"id": options.model_name, "object": "model", "created": created, "owned_by": "maxtext"}
    return {"object": "list", "data": [{**card, "root": options.model_name, "max_model_len": server.engine.max_length}]}

  @api.get("/tokenizer_info")
  def tokenizer_info():
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    specials = {name: tokenizer.special_tokens.get(name) for name in names}
    return {**specials, "chat_template": options.chat_template, "model_max_length": server.engine.max_length}

  @api.post("/tokenize")
  async def tokenize(request: fastapi.Request):
    body = await server.body(request, TokenizeBody)

    def work():
      bos = [tokenizer.bos_id] if body.add_special_tokens and options.add_bos and tokenizer.bos_id >= 0 else []
      tokens = bos + tokenizer.encode_with_specials(body.prompt)
      rest = f', "count": {len(tokens)}, "max_model_len": {server.engine.max_length}}}'
      return responses.Response('{"tokens": ' + _json_ints(tokens) + rest, media_type="application/json")

    return await server.run(work)

  @api.post("/detokenize")
  async def detokenize(request: fastapi.Request):
    body = await server.body(request, DetokenizeBody)

    def work():
      check_ids(body.tokens, tokenizer.vocab_size, "tokens")
      return responses.JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    return await server.run(work)


def _json_ints(values: list[int], piece: int = 1 << 16) -> str:
  """A JSON array of ints, rendered a piece at a time (json.dumps of a whole long list holds the GIL throughout)."""
  return "[" + ",".join(json.dumps(values[i : i + piece])[1:-1] for i in range(0, len(values), piece) if values) + "]"
