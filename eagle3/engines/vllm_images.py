"""vLLM's chat endpoint for image prompts: the ONE home of the facts the vLLM capture (data/capture_vllm.py)
relies on to send an image conversation to the engine and read back the engine's own expansion of it. The
hidden-state side (connector files, layer ids) is eagle3/engines/vllm_protocol.py's; the test stand-in
(tests/standins/vllm_standin.py) calls these functions too.

Read from the source of vLLM 0.34.0 (the version vllm_protocol names); tests/test_vllm_sources.py runs the
parts that run on CPU:
- The prompt is prepare's own token ids, decoded with each run of `<|media_pad|>` collapsed to one, sent as
  one user message whose content is that text plus one `image_url` part (a data URI) per image, under a
  request chat template that renders content verbatim (PASSTHROUGH_TEMPLATE), with no generation prompt.
  * renderers/hf.py `_detect_content_format`: a template that does not loop over `content` reads content as
    a "string"; renderers/chat_utils/chat_message.py `get_full_multimodal_text_prompt`: text parts are
    joined with "\\n", a placeholder string already in the text stays where it is (only missing ones are
    put in front), so the images land where prepare put them;
  * model_executor/models/kimi_k25.py: `get_placeholder_str("image")` is PLACEHOLDER (K2.5's block with one
    pad), and `KimiK25MultiModalProcessor._get_prompt_updates` replaces each `<|media_pad|>` id by
    `media_tokens_calculator(image)` copies: the engine's expansion, which the capture compares with prepare's;
  * renderers/online_renderer.py `validate_chat_template`: a request's chat template is refused unless the
    server runs with SERVE_FLAG.
- entrypoints/openai/chat_completion/protocol.py: ChatCompletionRequest takes `chat_template`,
  `add_generation_prompt`, `max_completion_tokens`, `return_token_ids`; ChatCompletionResponse carries
  `prompt_token_ids` (the engine prompt, after the expansion; serving.py sets it when return_token_ids),
  `kv_transfer_params` (the connector's file) and `choices[0].token_ids`.
- entrypoints/llm.py `LLM.chat(messages, sampling_params, use_tqdm=, chat_template=, add_generation_prompt=)`
  is the in-process form; its RequestOutput carries `prompt_token_ids`.
- No fused rows: the connector's states are `hidden_states + residual` before decoder layer `id` runs
  (model_executor/models/deepseek_v2.py, DeepseekV2Model.forward 1561-1562), and before layer 0 the residual
  is None (line 1525), so h = 0, the fused input embedding at image rows, cannot be asked for: a vLLM
  capture keeps no fused rows (eagle3/formats/store.py image_rows="none"), and only image_embeddings=placeholder
  (what vLLM's own Eagle3LlamaForCausalLM feeds) trains on it.

Nothing here has run against a real vLLM engine (it cannot run on the project's machines). Imports only
eagle3.engines.vllm_protocol (torch; core code) and eagle3.media_tokens (stdlib).
"""
from __future__ import annotations

from typing import Sequence

from eagle3.engines import vllm_protocol
from eagle3.media_tokens import image_block

PLACEHOLDER = image_block(1)  # vLLM's get_placeholder_str("image"): K2.5's image block with one pad
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
SERVE_FLAG = "--trust-request-chat-template"
CHAT_PATH = "/v1/chat/completions"


def collapse_runs(token_ids: Sequence[int], pad_id: int) -> list[int]:
    """`token_ids` with every run of `pad_id` cut to one pad (the form the engine expands)."""
    out: list[int] = []
    for t in token_ids:
        t = int(t)
        if not (t == pad_id and out and out[-1] == pad_id):
            out.append(t)
    return out


def chat_messages(text: str, image_uris: Sequence[str]) -> list[dict]:
    """One user message: the verbatim prompt text (one PLACEHOLDER per image, in order), then the images."""
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in image_uris)]}]


def chat_kwargs() -> dict:
    """Rendering settings of both forms (the HTTP body's keys and LLM.chat's keyword arguments)."""
    return {"chat_template": PASSTHROUGH_TEMPLATE, "add_generation_prompt": False}


def chat_body(model: str, text: str, image_uris: Sequence[str]) -> dict:
    """POST /v1/chat/completions body: one greedy token, the engine prompt's ids echoed back."""
    return {"model": model, "messages": chat_messages(text, image_uris), **chat_kwargs(),
            "max_completion_tokens": 1, "temperature": 0.0, "return_token_ids": True}


def parse_chat(reply: dict) -> tuple[str, int | None, list[int]]:
    """(connector file path, the engine's greedy next token or None, the engine's prompt ids) of a chat reply."""
    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
    path = params.get(vllm_protocol.PATH_PARAM) if isinstance(params, dict) else None
    if not isinstance(path, str):
        raise vllm_protocol.VllmProtocolError(
            f"chat reply has no kv_transfer_params.{vllm_protocol.PATH_PARAM} (is the server running with "
            f"--kv-transfer-config {vllm_protocol.CONNECTOR}?): {str(reply)[:200]}")
    prompt = reply.get("prompt_token_ids")
    if not isinstance(prompt, list):
        raise vllm_protocol.VllmProtocolError("chat reply has no prompt_token_ids (return_token_ids not honoured?)")
    generated = ((reply.get("choices") or [{}])[0] or {}).get("token_ids") or []
    return path, (int(generated[0]) if generated else None), [int(t) for t in prompt]


def is_client_error(e: BaseException) -> bool:
    """An in-process engine's refusal of the request itself (vllm/exceptions.py: VLLMClientError, the 4xx
    family, e.g. VLLMValidationError; the processor's ValueError for an image it cannot use)."""
    return isinstance(e, ValueError) or any(c.__name__ == "VLLMClientError" for c in type(e).__mro__)


def parse_chat_output(output) -> tuple[str, int | None, list[int]]:
    """The same from an in-process `vllm.RequestOutput` of LLM.chat."""
    path, greedy = vllm_protocol.parse_request_output(output)
    prompt = getattr(output, "prompt_token_ids", None)
    if prompt is None:
        raise vllm_protocol.VllmProtocolError("vLLM RequestOutput has no prompt_token_ids")
    return path, greedy, [int(t) for t in prompt]
