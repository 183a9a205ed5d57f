"""What Tandem does with each request field of OpenAI's Chat Completions and Completions
bodies and of vLLM's extras: implemented, accepted with no effect, or refused.

One table serves three readers: the request models (router/openai_api.py) refuse what
it marks refused, README's request-field table is rendered from it (``markdown_table``),
and a test checks that it lists every field the installed openai client can send.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import FieldError

IMPLEMENTED, NO_EFFECT, REFUSED = "implemented", "accepted, no effect", "refused"
CHAT, COMPLETIONS, BOTH = "chat", "completions", "both"


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: str
    """chat | completions | both"""
    defined_by: str
    """OpenAI, vLLM, both, or Tandem"""
    status: str
    note: str = ""
    """What it does here; for a refused field, the 400's reason (the field's default,
    or null, is always accepted)."""


def _f(name: str, endpoints: str, defined_by: str, status: str, note: str = "") -> RequestField:
    return RequestField(name, endpoints, defined_by, status, note)


FIELDS: tuple[RequestField, ...] = (
    _f("model", BOTH, "OpenAI", IMPLEMENTED, "the served model's name (or absent); another is a 404"),
    _f("messages", CHAT, "OpenAI", IMPLEMENTED, "text content parts; roles system, user, assistant (with tool_calls), tool"),
    _f("prompt", COMPLETIONS, "OpenAI", IMPLEMENTED, "a string, token ids, or a list of up to 256 of either: a choice per prompt (index i is prompt i), streamed interleaved; a prompt's error names prompt[i]"),
    _f("max_tokens", BOTH, "OpenAI", IMPLEMENTED, "completions: 0 generates nothing (with echo: the prompt and its logprobs)"),
    _f("max_completion_tokens", CHAT, "OpenAI", IMPLEMENTED, "max_tokens wins when both are set"),
    _f("temperature", BOTH, "OpenAI", IMPLEMENTED, "[0, 2]; 0 is greedy"),
    _f("top_p", BOTH, "OpenAI", IMPLEMENTED),
    _f("presence_penalty", BOTH, "OpenAI", IMPLEMENTED),
    _f("frequency_penalty", BOTH, "OpenAI", IMPLEMENTED),
    _f("logit_bias", BOTH, "OpenAI", IMPLEMENTED, "token id -> bias in [-100, 100], added to the logits; an id outside the vocabulary is a 400"),
    _f("seed", BOTH, "OpenAI", IMPLEMENTED, "the request's own RNG stream"),
    _f("stop", BOTH, "OpenAI", IMPLEMENTED, "at most 32 strings of 256 characters"),
    _f("stream", BOTH, "OpenAI", IMPLEMENTED),
    _f("stream_options", BOTH, "OpenAI", IMPLEMENTED, "include_usage; vLLM's continuous_usage_stats (with include_usage, every chunk carries the usage so far); include_obfuscation has no effect"),
    _f("logprobs", BOTH, "OpenAI", IMPLEMENTED, "chat: bool; completions: top N in [0, 20]"),
    _f("top_logprobs", CHAT, "OpenAI", IMPLEMENTED, "[0, 20]"),
    _f("n", BOTH, "OpenAI", IMPLEMENTED, "1 to 16 (MAX_CHOICES); one prefill, the choices fork the prompt's KV blocks copy-on-write; with a seed, choice j has its own reproducible stream (choice 0 equals n = 1); a batch of prompts numbers choice j of prompt i as i*n + j; not with streamed tool calls"),
    _f("best_of", COMPLETIONS, "both", IMPLEMENTED, "n to 16: generates best_of, returns the n with the highest cumulative logprob; below n, or above n with stream, is a 400"),
    _f("echo", BOTH, "both", IMPLEMENTED, "completions: the prompt's text before the completion and, with logprobs N, its tokens first in the logprobs object (the first token's logprob and top_logprobs null), computed in prefill; chat: only false (a 400)"),
    _f("suffix", COMPLETIONS, "OpenAI", REFUSED, "insertion is not supported"),
    _f("response_format", BOTH, "both", IMPLEMENTED, "text, json_object, json_schema (constrained decoding)"),
    _f("tools", CHAT, "OpenAI", IMPLEMENTED, "function tools; calls are written in the form the model's chat template teaches (Qwen's `<tool_call>` blocks, Llama 3's JSON object, else a `<tool_call>` JSON array: docs/architecture.md)"),
    _f("tool_choice", CHAT, "OpenAI", IMPLEMENTED, "none, auto, required, or a named function"),
    _f("parallel_tool_calls", CHAT, "OpenAI", IMPLEMENTED, "false: at most one call"),
    _f("user", BOTH, "OpenAI", NO_EFFECT),
    _f("metadata", BOTH, "OpenAI", NO_EFFECT, "nothing is stored"),
    _f("store", BOTH, "OpenAI", NO_EFFECT, "nothing is stored"),
    _f("service_tier", BOTH, "OpenAI", NO_EFFECT, "one tier; priority orders requests"),
    _f("safety_identifier", BOTH, "OpenAI", NO_EFFECT),
    _f("prompt_cache_key", BOTH, "OpenAI", NO_EFFECT, "placement already follows cached prefixes"),
    _f("prompt_cache_retention", CHAT, "OpenAI", NO_EFFECT),
    _f("prompt_cache_options", CHAT, "OpenAI", NO_EFFECT),
    _f("reasoning_effort", CHAT, "both", NO_EFFECT),
    _f("verbosity", CHAT, "OpenAI", NO_EFFECT),
    _f("prediction", CHAT, "OpenAI", NO_EFFECT, "a latency hint; the output is the same"),
    _f("modalities", CHAT, "OpenAI", REFUSED, "only [\"text\"]: no audio output"),
    _f("audio", CHAT, "OpenAI", REFUSED, "no audio output"),
    _f("web_search_options", CHAT, "OpenAI", REFUSED, "no web search"),
    _f("moderation", CHAT, "OpenAI", REFUSED, "no moderation"),
    _f("functions", CHAT, "OpenAI", REFUSED, "deprecated: use tools"),
    _f("function_call", CHAT, "OpenAI", REFUSED, "deprecated: use tool_choice"),
    _f("top_k", BOTH, "vLLM", IMPLEMENTED),
    _f("min_p", BOTH, "vLLM", IMPLEMENTED),
    _f("repetition_penalty", BOTH, "vLLM", IMPLEMENTED, "(0, 2]"),
    _f("min_tokens", BOTH, "vLLM", IMPLEMENTED, "EOS and stop_token_ids masked, stop strings not looked for, before N tokens"),
    _f("stop_token_ids", BOTH, "vLLM", IMPLEMENTED),
    _f("include_stop_str_in_output", BOTH, "vLLM", IMPLEMENTED),
    _f("ignore_eos", BOTH, "vLLM", IMPLEMENTED),
    _f("skip_special_tokens", BOTH, "vLLM", IMPLEMENTED),
    _f("spaces_between_special_tokens", BOTH, "vLLM", NO_EFFECT, "the tokenizer's decoder decides"),
    _f("bad_words", BOTH, "vLLM", IMPLEMENTED, "each word (with and without a leading space) is never completed"),
    _f("allowed_token_ids", BOTH, "vLLM", IMPLEMENTED, "every token is one of them; ids outside the vocabulary are a 400"),
    _f("truncate_prompt_tokens", BOTH, "vLLM", IMPLEMENTED, "keep the prompt's last N tokens; -1: as many as the context window holds (under a bounded kv_policy: --max-stream-len), with room for max_tokens"),
    _f("return_token_ids", BOTH, "vLLM", IMPLEMENTED, "prompt_token_ids and each choice's token_ids in the response"),
    _f("return_tokens_as_token_ids", BOTH, "vLLM", IMPLEMENTED, "logprobs name tokens token_id:<id>"),
    _f("add_special_tokens", BOTH, "vLLM", IMPLEMENTED, "completions default true, chat false"),
    _f("add_generation_prompt", CHAT, "vLLM", IMPLEMENTED),
    _f("chat_template_kwargs", CHAT, "vLLM", IMPLEMENTED, "extra chat template variables"),
    _f("continue_final_message", CHAT, "vLLM", REFUSED, "only false for now"),
    _f("chat_template", CHAT, "vLLM", REFUSED, "the model's own template only"),
    _f("documents", CHAT, "vLLM", REFUSED, "no RAG documents in the template"),
    _f("mm_processor_kwargs", CHAT, "vLLM", REFUSED, "text only"),
    _f("include_reasoning", CHAT, "vLLM", NO_EFFECT, "no reasoning parser"),
    _f("guided_json", BOTH, "vLLM", IMPLEMENTED),
    _f("guided_regex", BOTH, "vLLM", IMPLEMENTED),
    _f("guided_choice", BOTH, "vLLM", IMPLEMENTED),
    _f("guided_grammar", BOTH, "vLLM", IMPLEMENTED),
    _f("structured_outputs", BOTH, "vLLM", IMPLEMENTED, "json, regex, choice, grammar, json_object"),
    _f("guided_decoding_backend", BOTH, "vLLM", NO_EFFECT, "always llguidance"),
    _f("guided_whitespace_pattern", BOTH, "vLLM", REFUSED, "not supported"),
    _f("structural_tag", BOTH, "vLLM", REFUSED, "not supported"),
    _f("prompt_logprobs", BOTH, "vLLM", IMPLEMENTED, "[0, 20]: each prompt token's logprob and the top N, computed in prefill (such a request takes no prefix-cache hit over its prompt); completions: in each choice, chat: in the response; rank is the token's place in the top N, null outside it"),
    _f("use_beam_search", BOTH, "vLLM", REFUSED, "no beam search"),
    _f("length_penalty", BOTH, "vLLM", NO_EFFECT, "beam search only"),
    _f("logits_processors", BOTH, "vLLM", REFUSED, "no code from requests"),
    _f("vllm_xargs", BOTH, "vLLM", REFUSED, "no custom extensions"),
    _f("kv_transfer_params", BOTH, "vLLM", REFUSED, "Tandem moves KV itself"),
    _f("request_id", BOTH, "vLLM", NO_EFFECT, "the router mints ids; send x-request-id to have yours echoed"),
    _f("prompt_embeds", COMPLETIONS, "vLLM", REFUSED, "token and text prompts only"),
    _f("priority", BOTH, "vLLM", IMPLEMENTED, "lower is more important; x-priority header wins"),
    _f("cache_salt", BOTH, "vLLM", IMPLEMENTED),
    _f("speculate", BOTH, "Tandem", IMPLEMENTED, "false: no speculative decoding for the request"),
    _f("kv_policy", BOTH, "Tandem", IMPLEMENTED, "full, streaming:sinks=S,window=W or h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score=mean]; to both halves of a P/D request; workers take it under --allow-request-kv-policy"),
)

_BY_NAME = {f.name: f for f in FIELDS}


def refuse_unsupported(body: Any) -> None:
    """FieldError naming the first refused field the body sets to anything but its
    default (modalities: anything but text)."""
    fields = type(body).model_fields
    for name in body.model_fields_set:
        f = _BY_NAME.get(name)
        if f is None or f.status != REFUSED or name not in fields:
            continue
        value = getattr(body, name)
        if name == "modalities":
            if value and "audio" in value:
                raise FieldError(name, f"{name}: {f.note}")
        elif value != fields[name].default:
            raise FieldError(name, f"{name}: {f.note}")


def markdown_table() -> str:
    """README's request-field table."""
    rows = ["| field | endpoints | defined by | Tandem | notes |", "|---|---|---|---|---|"]
    for f in FIELDS:
        rows.append(f"| `{f.name}` | {f.endpoints} | {f.defined_by} | {f.status} | {f.note} |")
    return "\n".join(rows) + "\n"
